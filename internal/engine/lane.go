package engine

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// The retry lane: a handler's "try this message again in d" (inbox.RetryAfter). The message is
// parked with its key instead of retried in place, so its partition moves on; later messages
// of its key wait behind it, other keys go on. Package inbox holds the lane (its table, the
// check every transaction makes, the drain); the engine only tells a parking from a failure.

// MinRetryAfter and MaxRetryAfter bound the delay of a RetryLater.
const (
	MinRetryAfter = 100 * time.Millisecond
	MaxRetryAfter = 7 * 24 * time.Hour
)

// RetryLater is a handler's error that asks for its message to be parked and tried again after
// After, without holding up its partition (inbox.RetryAfter builds it).
type RetryLater struct {
	Err   error
	After time.Duration
}

func (e *RetryLater) Error() string {
	return fmt.Sprintf("retry after %s: %v", e.After, e.Err)
}

// Unwrap returns the handler's error.
func (e *RetryLater) Unwrap() error { return e.Err }

// NewRetryLater returns err as a RetryLater after d, clamped to [MinRetryAfter, MaxRetryAfter]
// (a nil err becomes "retry requested").
func NewRetryLater(err error, d time.Duration) error {
	if err == nil {
		err = errors.New("retry requested")
	}
	return &RetryLater{Err: err, After: min(max(d, MinRetryAfter), MaxRetryAfter)}
}

// AsRetryLater returns the RetryLater in err's chain, or nil.
func AsRetryLater(err error) *RetryLater {
	var rl *RetryLater
	if errors.As(err, &rl) {
		return rl
	}
	return nil
}

// Later says why and for how long a message is parked (Parker.SettleLater).
type Later struct {
	// Source is where the message came from, as GiveUp.Source.
	Source string
	// Attempts is how many times the message failed so far, this one included.
	Attempts int
	// Err is the handler's error (a *RetryLater); After the delay it asked for.
	Err   error
	After time.Duration
}

// ErrNoLane is returned by a Parker that cannot park the messages of its processor (it has no
// retry lane): the RetryLater then counts as an ordinary failed attempt.
var ErrNoLane = errors.New("onceflow: this processor has no retry lane")

// Parker is a BatchProcessor with a retry lane (the processors of inbox.Inbox.Batch,
// BatchNoPublish and BatchFunc): a message whose handler returned a RetryLater is parked
// rather than retried in place.
type Parker interface {
	// SettleLater parks msg in one transaction with its dedup row, so the consumer moves past
	// it exactly once and a redelivery is skipped; the lane applies it when due, before any
	// later message of its key. An error means nothing was recorded (ErrNoLane: the processor
	// has no lane); the consumer retries.
	SettleLater(ctx context.Context, msg *message.Message, l Later) error
}

// park settles msg in p's lane, retrying until the database takes it or ctx ends. It reports
// false, with nil, when p has no lane.
func (rp RetryPolicy) park(ctx context.Context, p BatchProcessor, msg *message.Message, l Later) (bool, error) {
	pk, ok := p.(Parker)
	if !ok {
		return false, nil
	}
	for failures := 0; ; failures++ {
		err := pk.SettleLater(ctx, msg, l)
		switch {
		case err == nil:
			return true, nil
		case errors.Is(err, ErrNoLane):
			return false, nil
		case ctx.Err() != nil:
			return false, ctx.Err()
		}
		if !rp.Refused(ctx, failures, 1, l.Source, fmt.Errorf("park message in the retry lane: %w", err)) {
			return false, ctx.Err()
		}
	}
}

// LaneDrainer is a BatchProcessor that applies its consumer's retry lane: the messages a
// batched consumer of its topics parked, once due. inboxkafka.BatchConsumer runs DrainLanes
// every LaneInterval while it runs; the processors of inbox.Inbox.Batch, BatchNoPublish and
// BatchFunc are LaneDrainers.
type LaneDrainer interface {
	// DrainLanes applies the due messages parked by a batched consumer of topics, each lane in
	// order, with rp's attempts and backoff for other errors, and returns how many it applied.
	// It returns early only when ctx ends or the schema is not migrated.
	DrainLanes(ctx context.Context, rp RetryPolicy, topics []string) (int, error)
	// LaneInterval is how often to call DrainLanes (inbox.Config.LaneInterval).
	LaneInterval() time.Duration
}
