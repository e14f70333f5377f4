// Package inboxkafka configures a watermill-kafka subscriber for an inbox consumer:
// process, then commit.
//
// watermill-kafka hands a partition's messages to the router one at a time and marks a
// message's offset only after the handler acknowledged it — and the inbox acknowledges only
// after its transaction committed. With auto-commit on (sarama's default), the marked offsets
// are sent to the broker every AutoCommit.Interval, so a crash re-delivers at most the
// messages acknowledged since the last commit, and the inbox skips them as duplicates.
//
// The settings that matter, all set by SaramaConfig:
//
//   - Consumer.Offsets.Initial = OffsetOldest: a new consumer group (or one whose offsets
//     expired) starts at the oldest retained message instead of skipping everything published
//     before it joined. Sarama's default, OffsetNewest, silently loses those messages.
//   - Consumer.Offsets.AutoCommit.Enable = true, every second: commits only offsets already
//     marked after Ack, so it never gets ahead of the effect. Disabling it makes watermill
//     commit synchronously after every message, which is slower and no safer with an inbox.
//   - Consumer.IsolationLevel = ReadCommitted: records of aborted producer transactions are
//     never handed to the handler.
//   - Consumer.Return.Errors = true, so sarama's errors reach watermill's logger.
//   - ConsumerGroup must be set (NewSubscriber refuses an empty one): without a group
//     watermill-kafka commits no offsets at all, and every restart starts over from Initial.
package inboxkafka

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"

	"github.com/onceflow/onceflow/inbox"
)

// AutoCommitInterval is how often marked offsets are committed: the most a crash can make
// the broker re-deliver (the inbox then skips those messages as duplicates).
const AutoCommitInterval = time.Second

// SaramaConfig returns watermill-kafka's default subscriber settings with the ones
// process-then-commit needs (see the package documentation). Adjust the rest (client id,
// TLS, SASL, session timeouts) on the returned value.
func SaramaConfig() *sarama.Config {
	c := kafka.DefaultSaramaSubscriberConfig()
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	c.Consumer.Offsets.AutoCommit.Enable = true
	c.Consumer.Offsets.AutoCommit.Interval = AutoCommitInterval
	c.Consumer.IsolationLevel = sarama.ReadCommitted
	c.Consumer.Return.Errors = true
	c.ClientID = "onceflow-inbox"
	return c
}

// SubscriberConfig returns a watermill-kafka subscriber config for consumerGroup on brokers,
// with SaramaConfig and watermill's default unmarshaler (the UUID travels in the
// _watermill_message_uuid header, metadata in the other headers — what the relay sends).
func SubscriberConfig(brokers []string, consumerGroup string) kafka.SubscriberConfig {
	return kafka.SubscriberConfig{
		Brokers:               brokers,
		ConsumerGroup:         consumerGroup,
		Unmarshaler:           kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: SaramaConfig(),
	}
}

// NewSubscriber returns a watermill-kafka subscriber built from SubscriberConfig. It refuses
// an empty consumer group, which would commit no offsets. logger may be nil.
func NewSubscriber(brokers []string, consumerGroup string, logger watermill.LoggerAdapter) (*kafka.Subscriber, error) {
	var problems []error
	if len(brokers) == 0 {
		problems = append(problems, errors.New("no brokers: pass the Kafka bootstrap addresses (host:port)"))
	}
	if consumerGroup == "" {
		problems = append(problems, errors.New("consumer group is empty: an inbox consumer needs a group, or no offsets are committed and every restart re-reads the topic"))
	}
	if err := errors.Join(problems...); err != nil {
		return nil, fmt.Errorf("inboxkafka: invalid subscriber settings: %w", err)
	}
	return kafka.NewSubscriber(SubscriberConfig(brokers, consumerGroup), logger)
}

// TraceAttributes is an inbox.Config.TraceAttributes that adds the Kafka coordinates
// watermill-kafka puts in a message's context to its `process` span:
// messaging.destination.partition.id, messaging.kafka.offset and messaging.kafka.message.key.
//
//	inbox.New(inbox.Config{Pool: pool, Consumer: "billing", TraceAttributes: inboxkafka.TraceAttributes})
func TraceAttributes(msg *message.Message) []attribute.KeyValue {
	ctx := msg.Context()
	attrs := make([]attribute.KeyValue, 0, 3)
	if p, ok := kafka.MessagePartitionFromCtx(ctx); ok {
		attrs = append(attrs, attribute.String("messaging.destination.partition.id", strconv.Itoa(int(p))))
	}
	if o, ok := kafka.MessagePartitionOffsetFromCtx(ctx); ok {
		attrs = append(attrs, attribute.Int64("messaging.kafka.offset", o))
	}
	if k, ok := kafka.MessageKeyFromCtx(ctx); ok && len(k) > 0 {
		attrs = append(attrs, attribute.String("messaging.kafka.message.key", string(k)))
	}
	return attrs
}

var _ inbox.TraceAttributesFunc = TraceAttributes
