package relay_test

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// A business transaction writes an event into the outbox; the relay publishes it to Kafka,
// where any consumer reads it with the partition key as Kafka key and the event id in the
// _watermill_message_uuid header. In a service the pool comes from pgxpool.New on
// DATABASE_URL and the brokers from KAFKA_BROKERS; the topic must exist before the relay
// sends to it (the relay does not create topics).
func Example() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{
		Kafka: onceflowtest.KafkaOptions{Topics: []string{"orders.placed"}},
	}) // a migrated database and an in-process Kafka with the topic created
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	pool, brokers := env.Pool, env.Brokers

	// 1. In the service: the event commits with the business change, or not at all.
	evt := outbox.SetPartitionKey(outbox.NewMessage([]byte(`{"order_id":42}`)), "order-42")
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// ... UPDATE orders SET status = 'placed' WHERE id = 42 ...
		return outbox.WriteTx(ctx, tx, "orders.placed", evt)
	})
	if err != nil {
		fmt.Println(err)
		return
	}

	// 2. In the relay process (or `onceflow relay`): publish until cancelled.
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: brokers})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer func() { _ = sink.Close() }()
	r, err := relay.New(relay.Config{Pool: pool, Sink: sink, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		fmt.Println(err)
		return
	}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()

	// 3. Anywhere: a plain Kafka consumer receives the event, with its id from the outbox.
	rec, err := consumeOne(ctx, brokers, "orders.placed")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(rec.Topic, string(rec.Key), string(rec.Value))
	for _, h := range rec.Headers {
		if h.Key == relaykafka.UUIDHeader {
			fmt.Println("same event id:", string(h.Value) == evt.UUID)
		}
	}
	stop()
	fmt.Println("relay stopped:", <-done)
	// Output:
	// orders.placed order-42 {"order_id":42}
	// same event id: true
	// relay stopped: <nil>
}

// consumeOne reads the first record of topic with a plain franz-go consumer.
func consumeOne(ctx context.Context, brokers []string, topic string) (*kgo.Record, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		fs := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if recs := fs.Records(); len(recs) > 0 {
			return recs[0], nil
		}
	}
}
