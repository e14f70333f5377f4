package relay_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/embedded"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// A business transaction writes an event into the outbox; the relay publishes it to Kafka,
// where any consumer reads it with the partition key as Kafka key and the event id in the
// _watermill_message_uuid header.
func Example() {
	ctx := context.Background()
	pool, brokers, cleanup := exampleInfra(ctx) // Postgres with the migrated schema, and Kafka
	defer cleanup()

	// 1. In the service: the event commits with the business change, or not at all.
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// ... UPDATE orders SET status = 'placed' WHERE id = 42 ...
		evt := outbox.SetPartitionKey(outbox.NewMessage([]byte(`{"order_id":42}`)), "order-42")
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
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()

	// 3. Anywhere: a plain Kafka consumer receives the event.
	rec := consumeOne(ctx, brokers, "orders.placed")
	fmt.Println(rec.Topic, string(rec.Key), string(rec.Value))
	stop()
	fmt.Println("relay stopped:", <-done)
	// Output:
	// orders.placed order-42 {"order_id":42}
	// relay stopped: <nil>
}

// exampleInfra starts a throwaway Postgres (with DATABASE_URL: a throwaway database on that
// server) with the default schema migrated, and an in-process Kafka.
func exampleInfra(ctx context.Context) (*pgxpool.Pool, []string, func()) {
	var stops []func()
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		pg, err := embedded.StartPostgres(ctx, embedded.PostgresOptions{})
		if err != nil {
			panic(err)
		}
		stops = append(stops, func() { _ = pg.Stop() })
		url = pg.URL()
	} else {
		admin, err := pgx.Connect(ctx, url)
		if err != nil {
			panic(err)
		}
		name := fmt.Sprintf("onceflow_example_%d", time.Now().UnixNano())
		if _, err := admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
			panic(err)
		}
		stops = append(stops, func() {
			_, _ = admin.Exec(ctx, "DROP DATABASE "+name+" WITH (FORCE)")
			_ = admin.Close(ctx)
		})
		cfg, err := pgx.ParseConfig(url)
		if err != nil {
			panic(err)
		}
		cfg.Database = name
		url = cfg.ConnString()
		pcfg, err := pgxpool.ParseConfig(url)
		if err != nil {
			panic(err)
		}
		pcfg.ConnConfig.Database = name
		pool, err := pgxpool.NewWithConfig(ctx, pcfg)
		if err != nil {
			panic(err)
		}
		return finishInfra(ctx, pool, stops)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		panic(err)
	}
	return finishInfra(ctx, pool, stops)
}

func finishInfra(ctx context.Context, pool *pgxpool.Pool, stops []func()) (*pgxpool.Pool, []string, func()) {
	stops = append(stops, pool.Close)
	if _, err := migrations.Up(ctx, pool, migrations.Options{}); err != nil {
		panic(err)
	}
	k, err := embedded.StartKafka(1)
	if err != nil {
		panic(err)
	}
	stops = append(stops, k.Stop)
	return pool, k.Brokers(), func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}
}

func consumeOne(ctx context.Context, brokers []string, topic string) *kgo.Record {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.MetadataMinAge(100*time.Millisecond))
	if err != nil {
		panic(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		fs := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			panic(err)
		}
		if recs := fs.Records(); len(recs) > 0 {
			return recs[0]
		}
	}
}
