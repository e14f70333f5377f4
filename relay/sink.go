package relay

import (
	"context"
	"errors"
)

// Sink delivers claimed rows to a broker. The relay calls Publish from one goroutine at a time.
//
// Publish sends msgs, which are in outbox order, and stores the outcome of msgs[i] in errs[i]
// (len(errs) == len(msgs), all nil on entry): nil means the broker acknowledged the message
// durably, so its row may be deleted. A Sink must keep per-key order within a call: once a
// message with key K failed, no later message with key K may be acknowledged in the same
// call; mark those ErrHeldBack (or fail them) instead. Errors wrapped with Undeliverable count
// toward the row's attempt limit; every other error is treated as transient and retried with
// backoff for as long as it takes.
//
// relay/relaykafka provides the Kafka sink; NewPublisherSink adapts any Watermill publisher.
type Sink interface {
	Publish(ctx context.Context, msgs []*Message, errs []error)
	// Close releases the sink's connections.
	Close() error
}

// ErrHeldBack marks a message that was not sent because an earlier message with the same key
// failed in the same call. Its row stays in the outbox and is sent after the earlier one.
var ErrHeldBack = errors.New("relay: held back: an earlier message with the same key failed")

// UndeliverableError marks a failure the broker will repeat for this message however often it
// is retried (too large, invalid record, invalid topic, ...). The relay counts such failures in
// outbox.attempts and parks the row after Config.MaxAttempts; every other error is retried
// with backoff and never parks a row.
//
// It is about the broker refusing a message, not about its content being wrong for a
// consumer: that is inbox.IsPoison.
type UndeliverableError struct{ Err error }

// Error prefixes the broker's error with "undeliverable: ".
func (e *UndeliverableError) Error() string { return "undeliverable: " + e.Err.Error() }

// Unwrap returns the broker's error.
func (e *UndeliverableError) Unwrap() error { return e.Err }

// Undeliverable wraps err as an UndeliverableError (nil stays nil). A Sink uses it for
// errors that retrying cannot fix, so the row counts toward parking.
func Undeliverable(err error) error {
	if err == nil {
		return nil
	}
	return &UndeliverableError{Err: err}
}

// IsUndeliverable reports whether err is, or wraps, an UndeliverableError.
func IsUndeliverable(err error) bool {
	var ue *UndeliverableError
	return errors.As(err, &ue)
}
