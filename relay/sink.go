package relay

import (
	"context"
	"errors"
	"strings"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
)

// Sink delivers claimed rows to a broker. The relay calls Publish from one goroutine at a time.
//
// Publish sends msgs, which are in outbox order, and stores the outcome of msgs[i] in errs[i]
// (len(errs) == len(msgs), all nil on entry): nil means the broker acknowledged the message
// durably, so its row may be deleted. A Sink must keep per-key order within a call: once a
// message with key K failed, no later message with key K may be acknowledged in the same
// call; mark those ErrHeldBack (or fail them) instead. Errors wrapped with Permanent count
// toward the row's attempt limit; every other error is treated as transient and retried with
// backoff for as long as it takes.
type Sink interface {
	Publish(ctx context.Context, msgs []*Message, errs []error)
	// Close releases the sink's connections.
	Close() error
}

// ErrHeldBack marks a message that was not sent because an earlier message with the same key
// failed in the same call. Its row stays in the outbox and is sent after the earlier one.
var ErrHeldBack = errors.New("relay: held back: an earlier message with the same key failed")

// PermanentError marks a failure the broker will repeat for this message however often it is
// retried (too large, invalid record, ...). The relay counts such failures in outbox.attempts
// and parks the row after Config.MaxAttempts.
type PermanentError struct{ Err error }

// Error marks the message as permanent.
func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }

// Unwrap returns the broker's error.
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent wraps err as a PermanentError (nil stays nil).
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// IsPermanent reports whether err is, or wraps, a PermanentError.
func IsPermanent(err error) bool {
	var pe *PermanentError
	return errors.As(err, &pe)
}

// PublisherSinkConfig configures NewPublisherSink.
type PublisherSinkConfig struct {
	// IsPermanent decides whether an error returned by the publisher will repeat forever for
	// that message. Default: sarama's non-retriable broker errors and its client-side
	// "message too large" and its marshaler's refusal of metadata using the UUID header (what a
	// watermill-kafka publisher returns), plus errors wrapped with Permanent. Everything else is retried with backoff and never parks a row.
	IsPermanent func(error) bool
}

// NewPublisherSink adapts any Watermill publisher: each message is one Publish call, in order,
// with the row's event id as message UUID and its metadata unchanged. The publisher must
// return only once the broker acknowledged the message (watermill-kafka's Publisher does).
// After a transient failure the rest of the batch is held back, so an unreachable broker
// costs one failed call per batch, not one per message.
func NewPublisherSink(pub message.Publisher, cfg PublisherSinkConfig) Sink {
	if cfg.IsPermanent == nil {
		cfg.IsPermanent = defaultIsPermanent
	}
	return &publisherSink{pub: pub, isPermanent: cfg.IsPermanent}
}

type publisherSink struct {
	pub         message.Publisher
	isPermanent func(error) bool
}

// Publish implements Sink: one Publish call per message, in order.
func (s *publisherSink) Publish(ctx context.Context, msgs []*Message, errs []error) {
	failedKeys := map[string]bool{}
	for i, m := range msgs {
		if err := ctx.Err(); err != nil {
			errs[i] = err
			continue
		}
		if failedKeys[m.blockKey] {
			errs[i] = ErrHeldBack
			continue
		}
		wm := m.Watermill()
		wm.SetContext(ctx)
		err := s.pub.Publish(m.Topic, wm)
		if err == nil {
			continue
		}
		failedKeys[m.blockKey] = true
		if s.isPermanent(err) {
			errs[i] = Permanent(err)
			continue
		}
		errs[i] = err
		for j := i + 1; j < len(msgs); j++ {
			errs[j] = ErrHeldBack
		}
		return
	}
}

// Close closes the wrapped publisher.
func (s *publisherSink) Close() error { return s.pub.Close() }

func defaultIsPermanent(err error) bool {
	if IsPermanent(err) {
		return true
	}
	// sarama refuses an oversized message client-side with a ConfigurationError.
	var ce sarama.ConfigurationError
	if errors.As(err, &ce) && strings.Contains(string(ce), "MaxMessageBytes") {
		return true
	}
	// watermill-kafka's marshalers refuse metadata using the UUID header (a plain error).
	if strings.Contains(err.Error(), "metadata "+UUIDHeader+" is reserved") {
		return true
	}
	var kerr sarama.KError
	if errors.As(err, &kerr) {
		switch kerr {
		case sarama.ErrMessageSizeTooLarge, sarama.ErrInvalidMessage, sarama.ErrInvalidRecord,
			sarama.ErrInvalidTopic, sarama.ErrPolicyViolation, sarama.ErrInvalidTimestamp,
			sarama.ErrMessageSetSizeTooLarge:
			return true
		}
	}
	return false
}

// errString shortens an error for the last_error column and logs.
func errString(err error) string {
	s := err.Error()
	const limit = 2000
	if len(s) > limit {
		s = s[:limit] + "…"
	}
	return s
}
