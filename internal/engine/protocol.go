package engine

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
)

// The batch protocol between a batched consumer (inboxkafka.BatchConsumer) and what applies
// its batches. Package inbox re-exports these types as aliases.

// BatchProcessor applies the messages of one partition in batches: what a batched consumer
// (inbox/inboxkafka.BatchConsumer) drives. An Inbox makes one from a Watermill handler
// (Inbox.Batch, Inbox.BatchNoPublish) or a set-based handler (Inbox.BatchFunc); the saga
// orchestrator and participants are BatchProcessors too.
//
// The consumer keeps the order of a partition: it hands ProcessBatch consecutive messages and
// moves on only when every one of them is settled — processed, skipped as a duplicate, or
// given up with SettlePoison.
type BatchProcessor interface {
	// ProcessBatch applies msgs in order. On success every message's effect and dedup row
	// have committed. On error nothing of the failed transaction is kept, and the error says
	// who failed: a *MessageError for one message (or, with Index −1, a set-based handler
	// that did not say which), any other error for the transaction as a whole (the database
	// could not be reached): the consumer then retries the same messages without counting an
	// attempt.
	//
	// It may commit in several transactions (a participant commits the messages before a
	// failed step separately): a message's effect always commits with its dedup row, so the
	// retry skips what already committed.
	ProcessBatch(ctx context.Context, msgs []*message.Message) error
	// SettlePoison records that msg is given up after g.Attempts failed attempts (g.Err is
	// the last error), in one transaction with its dedup row, so the consumer moves past it
	// exactly once and a redelivery is skipped. An error means nothing was recorded; the
	// consumer retries.
	SettlePoison(ctx context.Context, msg *message.Message, g GiveUp) error
}

// MessageError is the error of a BatchProcessor whose handler failed on one message: it counts
// an attempt against that message.
type MessageError struct {
	// Index is the failed message's position in the batch, or −1 when a set-based handler
	// failed without saying which message caused it (the consumer then splits the batch in
	// halves to find it).
	Index int
	Err   error
}

func (e *MessageError) Error() string {
	if e.Index < 0 {
		return "batch handler: " + e.Err.Error()
	}
	return fmt.Sprintf("message %d of the batch: %v", e.Index, e.Err)
}

func (e *MessageError) Unwrap() error { return e.Err }

// GiveUp says why a message is given up.
type GiveUp struct {
	// Source is where the message came from, e.g. "orders.placed/3@1234" (topic, partition,
	// offset), as shown by `onceflow inbox poison`.
	Source string
	// Attempts is how many times the message failed; Err is its last error.
	Attempts int
	Err      error
	// Handler and PublishTopic are, for a router consumer (the Poison middleware), the
	// Watermill handler the message failed in and its publish topic: a replay runs that
	// handler again (Inbox.RouterPlugin). Empty for batched consumers.
	Handler, PublishTopic string
	// NoReplay, when set, says why `onceflow inbox poison replay` must refuse this message
	// and what to do instead: the saga engine sets it for a reply whose saga it set stuck
	// (`onceflow saga retry` resumes the saga) and for an invalid command.
	NoReplay string
}

// ErrPanicked is wrapped by the error of a message whose handler (or saga definition code)
// panicked: every consumer recovers the panic into that message's error, which counts an
// attempt like any other. Only the router's middleware panics again, after its rollback, for
// Watermill's Recoverer.
var ErrPanicked = errors.New("onceflow: handler panicked")

// PanicError is a recovered panic as its message's error. Value is what was passed to panic.
type PanicError struct{ Value any }

func (e *PanicError) Error() string { return fmt.Sprintf("%v: %v", ErrPanicked, e.Value) }

// Unwrap returns ErrPanicked.
func (e *PanicError) Unwrap() error { return ErrPanicked }

// Call runs fn and returns what it returns, or, when it panics, a *PanicError: one message's
// panic fails that message (and is isolated), not the consumer.
func Call[T any](fn func() (T, error)) (out T, err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &PanicError{Value: v}
		}
	}()
	return fn()
}
