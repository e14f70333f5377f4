package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/outbox"
)

// inboxBench* size the inbox scenario: the same pre-produced messages are consumed once per
// system, each by a fresh consumer group, over several partitions so the router handles
// several messages at once (watermill-kafka handles one message at a time per partition).
const (
	inboxBenchMessages   = 20000
	inboxBenchPartitions = 8
)

// benchInbox: messages/s through a Watermill router reading Kafka with watermill-kafka, where
// the handler does one INSERT — behind the inbox (dedup row + INSERT in one transaction),
// against the same handler running its own transaction without dedup.
func benchInbox(ctx context.Context, e *env) ([]result, error) {
	pool, schema, err := e.freshSchema(ctx, "inbox")
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	topic, err := prepareInboxBench(ctx, e, pool, "inbox")
	if err != nil {
		return nil, err
	}
	bareRate, inboxRate, err := measureInboxRouter(ctx, e, pool, schema, topic)
	if err != nil {
		return nil, err
	}
	return []result{
		{Scenario: "inbox", System: "bare-handler", Value: bareRate, Unit: "msg/s", HigherIsBetter: true},
		{Scenario: "inbox", System: "onceflow", Value: inboxRate, Unit: "msg/s", HigherIsBetter: true, Target: "≥ 0.5× bare-handler"},
	}, nil
}

// effectHandlerSQL is the handlers' one INSERT, the effect of every inbox row.
const effectHandlerSQL = `INSERT INTO effect (msg_uuid, payload) VALUES ($1, $2)`

// prepareInboxBench creates the effect table in pool's schema and a topic pre-filled by
// produceInboxBench, and returns the topic.
func prepareInboxBench(ctx context.Context, e *env, pool *pgxpool.Pool, name string) (string, error) {
	if _, err := pool.Exec(ctx, `CREATE TABLE effect (id bigserial PRIMARY KEY, msg_uuid text NOT NULL, payload bytea NOT NULL)`); err != nil {
		return "", err
	}
	topic := fmt.Sprintf("bench-%s-%d", name, time.Now().UnixNano())
	if err := produceInboxBench(e.brokers, topic); err != nil {
		return "", err
	}
	return topic, nil
}

// measureInboxRouter consumes topic twice through a Watermill router, each time with a fresh
// group: a bare handler running its own transaction, then the same INSERT behind the inbox
// (consumer "bench"). It checks each run's effects (every message once) and leaves the
// effect table empty.
func measureInboxRouter(ctx context.Context, e *env, pool *pgxpool.Pool, schema, topic string) (bareRate, inboxRate float64, err error) {
	// Baseline: the handler opens and commits its own transaction, no dedup.
	bare := func(msg *message.Message) ([]*message.Message, error) {
		tx, err := pool.Begin(msg.Context())
		if err != nil {
			return nil, err
		}
		defer tx.Rollback(context.WithoutCancel(msg.Context()))
		if _, err := tx.Exec(msg.Context(), effectHandlerSQL, msg.UUID, msg.Payload); err != nil {
			return nil, err
		}
		return nil, tx.Commit(msg.Context())
	}
	bareRate, err = consumeInboxBench(ctx, e, topic, "bench-bare", nil, bare)
	if err != nil {
		return 0, 0, fmt.Errorf("bare-handler: %w", err)
	}
	if err := checkEffects(ctx, pool, inboxBenchMessages); err != nil {
		return 0, 0, fmt.Errorf("bare-handler: %w", err)
	}
	if _, err := pool.Exec(ctx, `TRUNCATE effect`); err != nil {
		return 0, 0, err
	}

	ib, err := inbox.New(inbox.Config{Pool: pool, Schema: schema, Consumer: "bench", Logger: e.log})
	if err != nil {
		return 0, 0, err
	}
	withInbox := func(msg *message.Message) ([]*message.Message, error) {
		_, err := outbox.MustTx(msg.Context()).Exec(msg.Context(), effectHandlerSQL, msg.UUID, msg.Payload)
		return nil, err
	}
	inboxRate, err = consumeInboxBench(ctx, e, topic, "bench-inbox", ib.Middleware, withInbox)
	if err != nil {
		return 0, 0, fmt.Errorf("inbox: %w", err)
	}
	if err := checkEffects(ctx, pool, inboxBenchMessages); err != nil {
		return 0, 0, fmt.Errorf("inbox: %w", err)
	}
	if err := checkDedup(ctx, pool, "bench", inboxBenchMessages); err != nil {
		return 0, 0, fmt.Errorf("inbox: %w", err)
	}
	if _, err := pool.Exec(ctx, `TRUNCATE effect`); err != nil {
		return 0, 0, err
	}
	return bareRate, inboxRate, nil
}

// checkDedup fails unless consumer has want dedup rows.
func checkDedup(ctx context.Context, pool *pgxpool.Pool, consumer string, want int) error {
	var dedup int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM processed_event WHERE consumer = $1`, consumer).Scan(&dedup); err != nil {
		return err
	}
	if dedup != want {
		return fmt.Errorf("%d dedup rows of consumer %q, want %d", dedup, consumer, want)
	}
	return nil
}

func checkEffects(ctx context.Context, pool *pgxpool.Pool, want int) error {
	var n, distinct int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT msg_uuid) FROM effect`).Scan(&n, &distinct); err != nil {
		return err
	}
	if n != want || distinct != want {
		return fmt.Errorf("%d effect rows (%d distinct messages), want %d", n, distinct, want)
	}
	return nil
}

// produceInboxBench creates the topic with inboxBenchPartitions partitions and fills it with
// inboxBenchMessages watermill-encoded messages (UUID header, partition key as Kafka key),
// as the relay would publish them.
// inboxBenchMeta is extra metadata produceInboxBench puts on every message.
var inboxBenchMeta map[string]string

func produceInboxBench(brokers []string, topic string) error {
	cfg := benchSaramaConfig()
	if err := createInboxBenchTopic(brokers, topic); err != nil {
		return err
	}
	producer, err := sarama.NewSyncProducer(brokers, cfg)
	if err != nil {
		return err
	}
	defer func() { _ = producer.Close() }()
	const chunk = 1000
	for n := 0; n < inboxBenchMessages; n += chunk {
		batch := make([]*sarama.ProducerMessage, 0, chunk)
		for i := n; i < n+chunk && i < inboxBenchMessages; i++ {
			msg := outbox.SetPartitionKey(outbox.NewMessage(benchPayload), keyName(i%200))
			for k, v := range inboxBenchMeta { // tracing.go
				msg.Metadata.Set(k, v)
			}
			pm, err := kafka.DefaultMarshaler{}.Marshal(topic, msg)
			if err != nil {
				return err
			}
			pm.Key = sarama.StringEncoder(outbox.PartitionKey(msg))
			batch = append(batch, pm)
		}
		if err := producer.SendMessages(batch); err != nil {
			return fmt.Errorf("produce: %w", err)
		}
	}
	return nil
}

func benchSaramaConfig() *sarama.Config {
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_1_0_0
	cfg.Producer.Return.Successes = true
	cfg.Producer.RequiredAcks = sarama.WaitForAll
	return cfg
}

// createInboxBenchTopic creates topic with inboxBenchPartitions partitions.
func createInboxBenchTopic(brokers []string, topic string) error {
	admin, err := sarama.NewClusterAdmin(brokers, benchSaramaConfig())
	if err != nil {
		return fmt.Errorf("kafka admin: %w", err)
	}
	err = admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: inboxBenchPartitions, ReplicationFactor: 1}, false)
	_ = admin.Close()
	if err != nil {
		return fmt.Errorf("create topic %s: %w", topic, err)
	}
	return nil
}

// consumeInboxBench runs a router with a fresh consumer group until every message was
// handled, and returns messages/s from the first handled message to the last (so group
// join time, the same for both systems, is left out).
func consumeInboxBench(ctx context.Context, e *env, topic, groupPrefix string, mw message.HandlerMiddleware, h message.HandlerFunc) (float64, error) {
	logger := watermill.NopLogger{}
	sub, err := kafka.NewSubscriber(inboxkafka.SubscriberConfig(e.brokers, fmt.Sprintf("%s-%d", groupPrefix, time.Now().UnixNano())), logger)
	if err != nil {
		return 0, err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: time.Minute}, logger)
	if err != nil {
		return 0, err
	}
	var done atomic.Int64
	var first, last atomic.Int64 // unix nanos
	finished := make(chan struct{})
	var once sync.Once
	count := func(next message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			first.CompareAndSwap(0, time.Now().UnixNano())
			out, err := next(msg)
			if err == nil {
				last.Store(time.Now().UnixNano())
				if done.Add(1) == inboxBenchMessages {
					once.Do(func() { close(finished) })
				}
			}
			return out, err
		}
	}
	router.AddMiddleware(count)
	if mw != nil {
		router.AddMiddleware(mw)
	}
	router.AddHandler("bench", topic, sub, "", inbox.OutboxOnly{}, h)
	rctx, cancel := context.WithCancel(ctx)
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(rctx) }()
	defer func() {
		cancel()
		if err := <-runErr; err != nil {
			e.log.Warn("inbox bench router", "err", err)
		}
	}()
	select {
	case <-finished:
	case err := <-runErr:
		return 0, fmt.Errorf("router stopped after %d messages: %v", done.Load(), err)
	case <-time.After(15 * time.Minute):
		return 0, fmt.Errorf("timed out after %d of %d messages", done.Load(), inboxBenchMessages)
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	took := time.Duration(last.Load() - first.Load())
	if took <= 0 {
		return 0, errors.New("no measurable duration")
	}
	return float64(inboxBenchMessages-1) / took.Seconds(), nil
}
