package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// TestDrainInOrder: a backlog written with the relay stopped is delivered completely, in
// per-key order, and the outbox ends empty.
func TestDrainInOrder(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 3)
	topic := kafkatest.Topic("drain")
	want := writeEvents(t, db, topic, 3000, 20, 50)
	want = append(want, writeEvents(t, db, topic, 200, 0, 10)...) // rows without a key too
	c := newConsumer(t, brokers, topic)
	r := newKafkaRelay(t, db, brokers, relay.Config{BatchSize: 500})
	stop := startRelay(t, r)
	got := c.waitDistinct(t, len(want), 60*time.Second)
	eventually(t, 30*time.Second, "empty outbox", func() bool { return outboxCount(t, db) == 0 })
	stop()
	if dups := checkDelivery(t, want, got); dups != 0 {
		t.Fatalf("%d duplicates without any fault", dups)
	}
}

// TestWatermillSubscriberReadsRelayedMessages: a plain watermill-kafka subscriber gets the
// event id as message UUID, the payload byte for byte and every metadata entry; the Kafka key
// is the partition key.
func TestWatermillSubscriberReadsRelayedMessages(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 1)
	topic := kafkatest.Topic("wire")

	keyed := outbox.SetPartitionKey(outbox.NewMessage([]byte{0x00, 0xff, 'x'}), "order-7")
	keyed.Metadata.Set("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	keyed.Metadata.Set("name", "Ünïcode ✓")
	unkeyed := outbox.NewMessage([]byte(`{"n":2}`))
	empty := outbox.NewMessage([]byte{})
	sent := []*message.Message{keyed, unkeyed, empty}
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
		if err != nil {
			return err
		}
		return w.WriteTx(ctx, tx, topic, sent...)
	})
	if err != nil {
		t.Fatal(err)
	}
	raw := newConsumer(t, brokers, topic)
	startRelay(t, newKafkaRelay(t, db, brokers, relay.Config{}))

	cfg := kafka.DefaultSaramaSubscriberConfig()
	cfg.Version = sarama.V2_8_0_0
	cfg.Consumer.Offsets.Initial = sarama.OffsetOldest
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers: brokers, Unmarshaler: kafka.DefaultMarshaler{}, OverwriteSaramaConfig: cfg,
	}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Close() }()
	sctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	ch, err := sub.Subscribe(sctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range sent {
		var got *message.Message
		select {
		case got = <-ch:
		case <-sctx.Done():
			t.Fatalf("watermill subscriber received %d of %d messages", i, len(sent))
		}
		got.Ack()
		if got.UUID != want.UUID {
			t.Fatalf("message %d: UUID %s, want the event id %s", i, got.UUID, want.UUID)
		}
		if string(got.Payload) != string(want.Payload) {
			t.Fatalf("message %d: payload %q, want %q", i, got.Payload, want.Payload)
		}
		if len(got.Metadata) != len(want.Metadata) {
			t.Fatalf("message %d: metadata %v, want %v", i, got.Metadata, want.Metadata)
		}
		for k, v := range want.Metadata {
			if got.Metadata.Get(k) != v {
				t.Fatalf("message %d: metadata %s = %q, want %q", i, k, got.Metadata.Get(k), v)
			}
		}
	}
	recs := raw.waitDistinct(t, len(sent), 30*time.Second)
	for _, r := range recs {
		want := ""
		if r.EventID == keyed.UUID {
			want = "order-7"
		}
		if r.Key != want {
			t.Fatalf("event %s: Kafka key %q, want %q", r.EventID, r.Key, want)
		}
	}
}

// TestPublisherSinkWithWatermillKafka: any Watermill publisher can be the sink; here
// watermill-kafka's own publisher (one message per round trip), with the partition key as the
// Kafka key. Delivery and per-key order hold as with the fast path.
func TestPublisherSinkWithWatermillKafka(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 3)
	topic := kafkatest.Topic("wmsink")
	want := writeEvents(t, db, topic, 600, 6, 20)
	c := newConsumer(t, brokers, topic)
	scfg := kafka.DefaultSaramaSyncPublisherConfig()
	scfg.Version = sarama.V2_8_0_0
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers: brokers,
		Marshaler: kafka.NewWithPartitioningMarshaler(func(_ string, m *message.Message) (string, error) {
			return outbox.PartitionKey(m), nil
		}),
		OverwriteSaramaConfig: scfg,
	}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	sink := relaykafka.NewPublisherSink(pub)
	defer func() { _ = sink.Close() }()
	r, err := relay.New(relay.Config{Pool: db.Pool, Sink: sink, Schema: db.Schema, BatchSize: 100, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	stop := startRelay(t, r)
	got := c.waitDistinct(t, len(want), 60*time.Second)
	eventually(t, 30*time.Second, "empty outbox", func() bool { return outboxCount(t, db) == 0 })
	stop()
	checkDelivery(t, want, got)
}
