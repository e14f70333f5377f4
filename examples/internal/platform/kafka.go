package platform

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// Partitions is the partition count of the topics the examples create.
const Partitions = 4

// CreateTopics creates the topics that do not exist yet. Topics are provisioned before
// anything subscribes, as in production: a consumer group that subscribes to a missing topic
// sits idle, and the relay retries a row for a missing topic until it appears.
func CreateTopics(ctx context.Context, brokers []string, topics ...string) error {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		return err
	}
	defer cl.Close()
	req := kmsg.NewPtrCreateTopicsRequest()
	for _, name := range topics {
		t := kmsg.NewCreateTopicsRequestTopic()
		t.Topic, t.NumPartitions, t.ReplicationFactor = name, Partitions, -1
		req.Topics = append(req.Topics, t)
	}
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return fmt.Errorf("create topics: %w", err)
	}
	for _, rt := range resp.Topics {
		if err := kerr.ErrorForCode(rt.ErrorCode); err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
			return fmt.Errorf("create topic %s: %w", rt.Topic, err)
		}
	}
	return nil
}

// NewSubscriber returns a watermill-kafka subscriber for one consumer group, with inboxkafka's
// process-then-commit settings and group timeouts, and static membership under instance:
// after a crash, the restarted process rejoins as the same member and gets its partitions back
// at once, instead of waiting out the dead member's session (inboxkafka.SessionTimeout). A
// process restarted under a new instance (a rescheduled pod) is a new member: the dead one is
// removed after its session timeout, and inboxkafka's read timeout above its rebalance timeout
// keeps the rebalance that follows from restarting itself. Use one subscriber, and so one
// consumer group, per handler, as Watermill's CQRS component does.
func NewSubscriber(brokers []string, group, instance string, log *slog.Logger) (message.Subscriber, error) {
	cfg := inboxkafka.SubscriberConfig(brokers, group)
	sc := cfg.OverwriteSaramaConfig // Version 2.8 already: static membership needs 2.3 or newer
	sc.Consumer.Group.InstanceId = instance
	return kafka.NewSubscriber(cfg, watermillLogger(log))
}

// RunRelay publishes the schema's outbox to Kafka from inside the service until ctx ends.
// It is the in-process form of `onceflow relay --schema ...`.
func RunRelay(ctx context.Context, pool *pgxpool.Pool, schema string, brokers []string, log *slog.Logger) error {
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: brokers})
	if err != nil {
		return err
	}
	r, err := relay.New(relay.Config{Pool: pool, Sink: sink, Schema: schema, Logger: log})
	if err != nil {
		return errors.Join(err, sink.Close())
	}
	return errors.Join(r.Run(ctx), sink.Close())
}

// NewRouter returns a Watermill router with the middlewares every example uses: Retry
// (transient failures are retried in place a few times; poison messages, such as one without
// a dedup key, are not: inbox.ShouldRetry) around Recoverer (a panic fails the message instead
// of the process). After the retries a message is nacked and watermill-kafka redelivers it.
func NewRouter(log *slog.Logger) (*message.Router, error) {
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermillLogger(log))
	if err != nil {
		return nil, err
	}
	retry := middleware.Retry{MaxRetries: 3, InitialInterval: 100 * time.Millisecond, ShouldRetry: inbox.ShouldRetry}
	r.AddMiddleware(retry.Middleware, middleware.Recoverer)
	return r, nil
}

// Consume subscribes h to topic under a consumer group of its own, named TopicPrefix + group.
func (f *Flags) Consume(r *message.Router, brokers []string, log *slog.Logger, group, topic string, h message.NoPublishHandlerFunc) error {
	sub, err := NewSubscriber(brokers, f.TopicPrefix+group, f.Instance, log)
	if err != nil {
		return err
	}
	r.AddConsumerHandler(group, topic, sub, h)
	return nil
}

// WaitRunning waits until the router's handlers run (or ctx ends).
func WaitRunning(ctx context.Context, r *message.Router) error {
	select {
	case <-r.Running():
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// watermillLogger logs Watermill's per-handler and per-subscriber start and stop lines at
// debug, so that the service's own info lines stand out.
func watermillLogger(log *slog.Logger) watermill.LoggerAdapter {
	return watermill.NewSlogLoggerWithLevelMapping(log, map[slog.Level]slog.Level{slog.LevelInfo: slog.LevelDebug})
}
