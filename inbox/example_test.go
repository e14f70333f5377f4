package inbox_test

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
)

// A billing consumer behind the inbox: the broker delivers the same order three times, the
// invoice is written once and its event lands in the outbox once. In a service the
// subscriber is inboxkafka.NewSubscriber(brokers, "billing", logger) and the pool comes from
// pgxpool.New(ctx, os.Getenv("DATABASE_URL")), on a database migrated with `onceflow migrate up`.
func Example() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{NoKafka: true}) // a throwaway, migrated database
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	pool := env.Pool
	if _, err := pool.Exec(ctx, `CREATE TABLE invoice (order_id int PRIMARY KEY)`); err != nil {
		fmt.Println(err)
		return
	}

	metrics := &inbox.Counters{}
	ib, err := inbox.New(inbox.Config{Pool: pool, Consumer: "billing", Metrics: metrics})
	if err != nil {
		fmt.Println(err)
		return
	}
	logger := watermill.NopLogger{}
	broker := gochannel.NewGoChannel(gochannel.Config{}, logger)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		fmt.Println(err)
		return
	}
	// Outermost first; the inbox goes innermost so every retry gets a fresh transaction.
	router.AddMiddleware(
		middleware.Retry{MaxRetries: 3, InitialInterval: 10 * time.Millisecond, ResetContextOnRetry: true, ShouldRetry: inbox.ShouldRetry}.Middleware,
		middleware.Recoverer,
		ib.Middleware,
	)
	router.AddHandler("billing", "orders.placed", broker, "billing.invoiced", inbox.OutboxOnly{},
		func(msg *message.Message) ([]*message.Message, error) {
			tx := outbox.MustTx(msg.Context()) // the inbox transaction: this write commits with the dedup row
			if _, err := tx.Exec(msg.Context(), `INSERT INTO invoice (order_id) VALUES (42)`); err != nil {
				return nil, err
			}
			// Returned messages go to the outbox (topic billing.invoiced) in the same transaction.
			return []*message.Message{outbox.NewMessage([]byte(`{"order_id":42}`))}, nil
		})
	go func() { _ = router.Run(ctx) }()
	defer router.Close()
	<-router.Running()

	order := outbox.NewMessage([]byte(`{"order_id":42}`))
	for range 3 {
		_ = broker.Publish("orders.placed", order.Copy()) // at-least-once delivery: same event id
	}
	// Wait until the three deliveries are handled (a test would use a deadline).
	for s := metrics.Snapshot(); s.Processed+s.Duplicates < 3; s = metrics.Snapshot() {
		time.Sleep(10 * time.Millisecond)
	}

	var invoices, events int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM invoice`).Scan(&invoices)
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM onceflow.outbox WHERE topic = 'billing.invoiced'`).Scan(&events)
	s := metrics.Snapshot()
	fmt.Printf("invoices: %d, events in the outbox: %d\n", invoices, events)
	fmt.Printf("processed: %d, duplicates skipped: %d\n", s.Processed, s.Duplicates)
	// Output:
	// invoices: 1, events in the outbox: 1
	// processed: 1, duplicates skipped: 2
}
