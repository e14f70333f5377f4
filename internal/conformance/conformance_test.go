// Package conformance runs Watermill's universal Pub/Sub test suite over the whole onceflow
// path, as a user wires it: a publisher that writes each Publish call into the outbox in its
// own transaction, a relay publishing the outbox to Kafka in the background, and a
// watermill-kafka subscriber with the inbox's recommended settings (inbox/inboxkafka).
//
// What the suite checks there is what docs/guarantees.md promises end to end: every message
// arrives (no loss, also across subscriber restarts and nacks), with the UUID, payload and
// metadata it was published with (stable identity), per partition key in publish order, and
// consumer groups that each get every message. Duplicates are allowed (at-least-once), as the
// inbox turns them into exactly-once effects.
package conformance_test

import (
	"context"
	"errors"
	"io"
	"log"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// partitions per topic: more than one, so the suite's concurrent subscribers of one consumer
// group share a topic's partitions, and per-key order is checked across partitions.
const partitions = 8

// baseFeatures are what onceflow promises for the outbox → relay → Kafka → subscriber path
// (docs/guarantees.md, docs/relay.md). The suite skips a test only where a feature below says
// it does not apply; each such case is explained here.
func baseFeatures() tests.Features {
	return tests.Features{
		// A subscriber joins a consumer group (inboxkafka refuses an empty one), and two groups
		// each receive every message.
		ConsumerGroups: true,
		// Delivery is at-least-once: the relay republishes after a crash, a subscriber that
		// closes before its offsets are committed gets messages again. Effects become
		// exactly-once in the inbox, which is not part of a Pub/Sub. With false, the suite
		// deduplicates by UUID and checks nothing is lost.
		ExactlyOnceDelivery: false,
		// Messages live in Kafka; a new subscriber of the same group resumes where the group's
		// committed offsets are (TestContinueAfterSubscribeClose, TestContinueAfterErrors).
		Persistent: true,
		// Order is promised per partition key only; messages without a key are spread over the
		// relay's shards by event id and have no order (docs/relay.md). The unkeyed run below
		// therefore does not claim order; the keyed run does.
		GuaranteedOrder: false,
		// False: TestNewSubscriberReceivesOldMessages is for subscribers without a consumer
		// group, each starting from the oldest message. An inbox consumer always has a group,
		// whose new members resume at the group's offsets (and inboxkafka refuses no group).
		NewSubscriberReceivesOldMessages: false,
		// No command restarts an in-process kfake cluster, so the suite skips TestReconnect
		// ("no RestartServiceCommand provided"). Broker outages and errors are covered by the
		// relay's own fault tests (relay: TestBrokerOutage, TestBrokerFaults).
		RestartServiceCommand: nil,
		// A message's context does not travel through PostgreSQL and Kafka; the subscriber's
		// messages get watermill-kafka's context, cancelled after Ack (TestMessageCtx checks it).
		ContextPreserved: false,
		// Any number of publishers and subscribers work side by side.
		RequireSingleInstance: false,
		// The suite's full sizes (up to 10,000 messages, 50 subscribers in one group): both
		// runs take about a minute under -race on two cores, half of it TestContinueAfterErrors
		// waiting out watermill-kafka's 100 ms sleep after each of its 300 nacks per run.
		// go test -short runs the suite's short sizes instead (about 20 s).
		ForceShort: false,
	}
}

// TestPubSub runs the suite with messages published as they are: no partition key.
func TestPubSub(t *testing.T) {
	t.Parallel()
	p := newPath(t, nil)
	tests.TestPubSub(t, baseFeatures(), p.pubSub, p.pubSubWithGroup)
}

// TestPubSubKeyed runs the suite again with every message's payload as its partition key, so
// the order promise applies: the suite's order test (TestPublishSubscribeInOrder) expects the
// messages of each payload in publish order, and TestNoAck two messages with the same payload.
// watermill-kafka's own ordered run (TestPublishSubscribe_ordered) does the same with a
// partitioning marshaler.
func TestPubSubKeyed(t *testing.T) {
	t.Parallel()
	p := newPath(t, func(msg *message.Message) {
		if outbox.PartitionKey(msg) == "" {
			outbox.SetPartitionKey(msg, string(msg.Payload))
		}
	})
	f := baseFeatures()
	f.GuaranteedOrder = true
	tests.TestPubSub(t, f, p.pubSub, p.pubSubWithGroup)
}

// path is one schema with a running relay and one Kafka cluster, shared by every test of a
// suite run (the suite gives each test its own topics).
type path struct {
	db      *testdb.DB
	w       *outbox.Writer
	brokers []string
	// prepare adjusts each message before it is written (the keyed run sets its key).
	prepare func(*message.Message)

	mu   sync.Mutex
	subs []*kafka.Subscriber // every subscriber created, closed at the end of the run
}

func newPath(t *testing.T, prepare func(*message.Message)) *path {
	quietSuiteLogs()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, partitions)
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: brokers})
	if err != nil {
		t.Fatal(err)
	}
	r, err := relay.New(relay.Config{Pool: db.Pool, Sink: sink, Schema: db.Schema, Logger: testLogger()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	// Cleanups run after every parallel subtest of the suite finished, last registered first:
	// stop the relay, then close its sink, then (registered earlier) Kafka and the database.
	t.Cleanup(func() { _ = sink.Close() })
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("relay.Run: %v", err)
			}
		case <-time.After(60 * time.Second):
			t.Error("relay.Run did not return within 60s of cancellation")
		}
	})
	p := &path{db: db, w: w, brokers: brokers, prepare: prepare}
	// Registered last, so it runs first: before the relay and Kafka stop.
	t.Cleanup(p.closeSubscribers)
	return p
}

// closeSubscribers closes every subscriber the run created that the suite left open.
// TestPublishSubscribeInOrder never closes its ten subscribers: it writes
// `defer require.NoError(t, sub.Close())`, which closes the multiplier before it subscribes
// (the deferred call's argument is evaluated at once), and the multiplier only closes the
// subscribers it has created at that point, none. Without this, their consumer-group
// goroutines would fail the package's leak check. Close is idempotent in watermill-kafka, so
// the subscribers the suite did close are unaffected.
func (p *path) closeSubscribers() {
	p.mu.Lock()
	subs := p.subs
	p.subs = nil
	p.mu.Unlock()
	for _, s := range subs {
		_ = s.Close()
	}
}

// pubSub is the suite's PubSubConstructor. Its subscriber puts each topic in a consumer group
// of its own, named after the topic (the suite's topics are unique per test): every subscriber
// a test creates for a topic joins that group, as the instances of one consuming service do.
//
// One group per topic rather than one per test, because a watermill-kafka subscriber blocks
// a partition's goroutine while its message waits in the output channel, and sarama cannot
// finish a rebalance until that goroutine returns. TestTopic subscribes to two topics and
// reads them one after the other: in one group, the member of the second topic holds its
// message unread while the first topic's member waits for the rebalance, and the test times
// out. A router reads all its subscriptions at once and does not stall like that.
func (p *path) pubSub(t *testing.T) (message.Publisher, message.Subscriber) {
	return &outboxPublisher{p: p}, &groupSubscriber{p: p, group: func(topic string) string { return "cg-" + topic }}
}

// pubSubWithGroup is the suite's ConsumerGroupPubSubConstructor: its subscriber joins the
// group the suite names.
func (p *path) pubSubWithGroup(t *testing.T, group string) (message.Publisher, message.Subscriber) {
	return &outboxPublisher{p: p}, &groupSubscriber{p: p, group: func(string) string { return group }}
}

// subscriber returns a watermill-kafka subscriber with the inbox's recommended settings
// (inboxkafka.SubscriberConfig) in consumer group group; its logs go to stderr with -v.
func (p *path) subscriber(group string) (*kafka.Subscriber, error) {
	cfg := inboxkafka.SubscriberConfig(p.brokers, group)
	// SubscribeInitialize, which the suite calls before publishing, creates the topic with
	// these details; watermill-kafka refuses it without them.
	cfg.InitializeTopicDetails = &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: 1}
	var logger watermill.LoggerAdapter = watermill.NopLogger{}
	if testing.Verbose() {
		logger = watermill.NewStdLogger(false, false)
	}
	sub, err := kafka.NewSubscriber(cfg, logger)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	p.subs = append(p.subs, sub)
	p.mu.Unlock()
	return sub, nil
}

// groupSubscriber subscribes through a new watermill-kafka subscriber per Subscribe call, in
// the consumer group that group names for the topic. A watermill-kafka subscriber does the
// same inside (each Subscribe call is a new group member); this only lets the group depend on
// the topic.
type groupSubscriber struct {
	p     *path
	group func(topic string) string

	mu     sync.Mutex
	closed bool
	subs   []*kafka.Subscriber
}

// errSubscriberClosed is returned by Subscribe after Close.
var errSubscriberClosed = errors.New("conformance: subscriber is closed")

func (g *groupSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return nil, errSubscriberClosed
	}
	sub, err := g.p.subscriber(g.group(topic))
	if err != nil {
		return nil, err
	}
	g.subs = append(g.subs, sub)
	return sub.Subscribe(ctx, topic)
}

// SubscribeInitialize creates the topic, as watermill-kafka's subscriber does.
func (g *groupSubscriber) SubscribeInitialize(topic string) error {
	sub, err := g.p.subscriber(g.group(topic))
	if err != nil {
		return err
	}
	return errors.Join(sub.SubscribeInitialize(topic), sub.Close())
}

// Close closes every subscription and waits until their channels are closed.
func (g *groupSubscriber) Close() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.closed = true
	var errs []error
	for _, s := range g.subs {
		errs = append(errs, s.Close())
	}
	return errors.Join(errs...)
}

// outboxPublisher is the publisher a service using onceflow has: each Publish call writes its
// messages into the outbox in one transaction of its own and commits. The relay publishes
// them once committed.
type outboxPublisher struct {
	p      *path
	closed atomic.Bool
}

// errClosed is returned by Publish after Close.
var errClosed = errors.New("conformance: publisher is closed")

func (o *outboxPublisher) Publish(topic string, msgs ...*message.Message) error {
	if o.closed.Load() {
		return errClosed
	}
	if o.p.prepare != nil {
		for _, m := range msgs {
			o.p.prepare(m)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return pgx.BeginFunc(ctx, o.p.db.Pool, func(tx pgx.Tx) error {
		return o.p.w.WriteTx(ctx, tx, topic, msgs...)
	})
}

// Close stops accepting messages. The pool, the relay and Kafka are shared with the other
// publishers of the run and closed when it ends.
func (o *outboxPublisher) Close() error {
	o.closed.Store(true)
	return nil
}

// testLogger sends the relay's logs to stderr with -v (warnings and errors only, since the
// suite's 15 tests run in parallel), and discards them otherwise.
func testLogger() *slog.Logger {
	if !testing.Verbose() {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// quietSuiteLogs silences the standard logger without -v: the suite logs every bulk read and
// nack with package log, thousands of lines that bury a failure's report.
func quietSuiteLogs() {
	if !testing.Verbose() {
		log.SetOutput(io.Discard)
	}
}
