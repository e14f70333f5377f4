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
//
// Group membership timeouts, chosen to agree with each other so that a consumer that crashed
// and was restarted under a new member id gets its partitions back within seconds:
//
//   - Consumer.Group.Session.Timeout = SessionTimeout (10 s), heartbeats every
//     HeartbeatInterval (3 s): how long the coordinator waits before it removes a member that
//     stopped heartbeating (a SIGKILLed process) and hands its partitions to the others.
//   - Consumer.Group.Rebalance.Timeout = RebalanceTimeout (20 s, sarama's default is 60 s):
//     how long the coordinator waits for every member to rejoin once a rebalance started, and
//     so how long a member that died during a rebalance can hold the group up. A member needs
//     only to finish its in-flight message (one transaction) before it rejoins.
//   - Net.ReadTimeout = ReadTimeout (25 s = RebalanceTimeout + 5 s, sarama's default is 30 s):
//     the coordinator holds a JoinGroup (and SyncGroup) reply until the rebalance completes,
//     up to the rebalance timeout. sarama applies one read timeout to every request, so a
//     read timeout below the rebalance timeout makes a member waiting in JoinGroup give up,
//     reconnect and join again, which restarts the rebalance it was waiting for: with sarama's
//     defaults (30 s below 60 s) a group with one dead member could stay in
//     PreparingRebalance for minutes. The Java client does the same (JoinGroup waits for the
//     rebalance timeout plus 5 s).
//   - Version = sarama.V2_8_0_0 (watermill-kafka's default is 1.0): JoinGroup v4 and newer,
//     where a member's id is assigned before it joins, so a process that dies half-way
//     through joining expires after its session timeout; and static membership: set
//     Consumer.Group.InstanceId to a name that survives restarts (a StatefulSet pod name) and
//     a restarted process takes its predecessor's place and partitions at once, without a
//     rebalance and without waiting for the session timeout.
//
// Every member of a group should use the same timeouts: the coordinator waits for the
// largest rebalance timeout among the members.
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

// Consumer group timeouts set by SaramaConfig (see the package documentation for why they
// are chosen together). If you raise RebalanceTimeout, raise Net.ReadTimeout with it: it
// must stay above the rebalance timeout.
const (
	// SessionTimeout is Consumer.Group.Session.Timeout: a member that sent no heartbeat for
	// this long is removed from the group.
	SessionTimeout = 10 * time.Second
	// HeartbeatInterval is Consumer.Group.Heartbeat.Interval, a third of SessionTimeout.
	HeartbeatInterval = 3 * time.Second
	// RebalanceTimeout is Consumer.Group.Rebalance.Timeout: how long a rebalance waits for
	// the members to rejoin.
	RebalanceTimeout = 20 * time.Second
	// ReadTimeout is Net.ReadTimeout: above RebalanceTimeout, because a JoinGroup reply may
	// take the whole rebalance timeout to come.
	ReadTimeout = RebalanceTimeout + 5*time.Second
)

// SaramaConfig returns watermill-kafka's default subscriber settings with the ones
// process-then-commit and quick recovery after a crash need (see the package
// documentation). Adjust the rest (client id, TLS, SASL, Consumer.Group.InstanceId for
// static membership) on the returned value.
func SaramaConfig() *sarama.Config {
	c := kafka.DefaultSaramaSubscriberConfig()
	c.Version = sarama.V2_8_0_0
	c.Consumer.Group.Session.Timeout = SessionTimeout
	c.Consumer.Group.Heartbeat.Interval = HeartbeatInterval
	c.Consumer.Group.Rebalance.Timeout = RebalanceTimeout
	c.Net.ReadTimeout = ReadTimeout
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
