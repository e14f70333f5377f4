package relay

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
)

// PublisherSinkConfig configures NewPublisherSink.
type PublisherSinkConfig struct {
	// IsUndeliverable decides whether an error returned by the publisher will repeat for that
	// message however often it is retried; such errors count toward the row's attempt limit
	// and park it after Config.MaxAttempts. Every other error is retried with backoff and never
	// parks a row.
	//
	// Default: IsUndeliverable, i.e. only errors the publisher wrapped with Undeliverable. The
	// core knows no broker's error types, so with a watermill-kafka publisher use
	// relaykafka.NewPublisherSink (or set relaykafka.SaramaUndeliverable here): otherwise a
	// message the broker always refuses (too large, invalid topic) is retried forever and
	// blocks its key.
	IsUndeliverable func(error) bool
}

// NewPublisherSink adapts any Watermill publisher: each message is one Publish call, in order,
// with the row's event id as message UUID and its metadata unchanged. The publisher must
// return only once the broker acknowledged the message (watermill-kafka's Publisher does).
// After a transient failure the rest of the batch is held back, so an unreachable broker
// costs one failed call per batch, not one per message.
//
// For a watermill-kafka publisher prefer relaykafka.NewPublisherSink, which recognises
// sarama's undeliverable errors (see PublisherSinkConfig.IsUndeliverable).
func NewPublisherSink(pub message.Publisher, cfg PublisherSinkConfig) Sink {
	if cfg.IsUndeliverable == nil {
		cfg.IsUndeliverable = IsUndeliverable
	}
	return &publisherSink{pub: pub, isUndeliverable: cfg.IsUndeliverable}
}

type publisherSink struct {
	pub             message.Publisher
	isUndeliverable func(error) bool
}

// Publish implements Sink: one Publish call per message, in order.
func (s *publisherSink) Publish(ctx context.Context, msgs []*Message, errs []error) {
	// Chains are computed from Key and ID rather than taken from the claim, so the sink keeps
	// order for Messages built by hand too (tests, wrappers).
	failedKeys := map[string]bool{}
	for i, m := range msgs {
		if err := ctx.Err(); err != nil {
			errs[i] = err
			continue
		}
		chain := blockKeyOf(m.Key, m.ID)
		if failedKeys[chain] {
			errs[i] = ErrHeldBack
			continue
		}
		wm := m.Watermill()
		wm.SetContext(ctx)
		err := s.pub.Publish(m.Topic, wm)
		if err == nil {
			continue
		}
		failedKeys[chain] = true
		if s.isUndeliverable(err) {
			if !IsUndeliverable(err) {
				err = Undeliverable(err)
			}
			errs[i] = err
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
