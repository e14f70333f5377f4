package relaykafka

import (
	"errors"
	"strings"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/relay"
)

// NewPublisherSink is relay.NewPublisherSink for a watermill-kafka publisher (sarama
// underneath): one Publish call per message, in order, with SaramaUndeliverable deciding which
// failures count toward parking. Sink (NewSink) is the faster path and keeps order under
// broker errors by construction; use this when production must go through a watermill-kafka
// publisher (its sarama config, marshaler or middleware). The publisher's sarama config cannot
// be read back from it: check it with CheckSaramaProducer before building the publisher
// (acks=all, idempotence, at most one request in flight).
func NewPublisherSink(pub message.Publisher) relay.Sink {
	return relay.NewPublisherSink(pub, relay.PublisherSinkConfig{IsUndeliverable: SaramaUndeliverable})
}

// SaramaUndeliverable reports whether an error returned by a watermill-kafka publisher will
// repeat for that message however often it is retried, for relay.PublisherSinkConfig's
// IsUndeliverable: sarama's non-retriable broker errors (message or message set too large,
// invalid message or record, invalid topic, policy violation, invalid timestamp), sarama's
// client-side refusal of a message over Producer.MaxMessageBytes, watermill-kafka's
// marshalers refusing metadata that uses UUIDHeader, and errors already marked with
// relay.Undeliverable. Everything else (broker down, timeouts, leader changes) is transient.
func SaramaUndeliverable(err error) bool {
	if err == nil {
		return false
	}
	if relay.IsUndeliverable(err) {
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
