package outbox_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
)

// Write a domain event in the same transaction as the business row: both commit or neither.
// In a service the pool comes from pgxpool.New(ctx, os.Getenv("DATABASE_URL")), on a
// database migrated with `onceflow migrate up`.
func ExampleWriteTx() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{NoKafka: true}) // a throwaway, migrated database
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	pool := env.Pool
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (id int PRIMARY KEY, status text NOT NULL);
		INSERT INTO orders VALUES (42, 'new'), (43, 'new')`); err != nil {
		fmt.Println(err)
		return
	}

	place := func(id int, payment error) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `UPDATE orders SET status = 'placed' WHERE id = $1`, id); err != nil {
				return err
			}
			key := fmt.Sprintf("order-%d", id) // the events of one order keep their order
			evt := outbox.SetPartitionKey(outbox.NewMessage(fmt.Appendf(nil, `{"order_id":%d}`, id)), key)
			if err := outbox.WriteTx(ctx, tx, "orders.placed", evt); err != nil {
				return err
			}
			return payment // an error rolls back the update and the event together
		})
	}
	fmt.Println("order 42:", place(42, nil))
	fmt.Println("order 43:", place(43, errors.New("payment declined")))

	// What the relay will publish: only the committed order's event.
	printOutbox(ctx, pool)
	// Output:
	// order 42: <nil>
	// order 43: payment declined
	// outbox: orders.placed key=order-42 {"order_id":42}
}

// A Watermill cqrs.EventBus (here publishing OrderPlaced{OrderID int}) built once on ContextPublisher writes each event into the
// transaction carried by the context it is published with. Code that already publishes
// through an EventBus keeps doing so; the events now commit with the business change.
func ExampleWriter_ContextPublisher() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{NoKafka: true})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()

	writer, err := outbox.NewWriter(outbox.Config{}) // the default schema, "onceflow"
	if err != nil {
		fmt.Println(err)
		return
	}
	bus, err := cqrs.NewEventBusWithConfig(writer.ContextPublisher(), cqrs.EventBusConfig{
		GeneratePublishTopic: func(p cqrs.GenerateEventPublishTopicParams) (string, error) {
			return "orders.placed", nil
		},
		Marshaler: cqrs.JSONMarshaler{NewUUID: outbox.NewUUID}, // UUIDv7 event ids
		OnPublish: func(p cqrs.OnEventSendParams) error { // the partition key keeps an order's events in order
			outbox.SetPartitionKey(p.Message, fmt.Sprintf("order-%d", p.Event.(*OrderPlaced).OrderID))
			return nil
		},
	})
	if err != nil {
		fmt.Println(err)
		return
	}

	for _, commit := range []bool{false, true} {
		err := pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
			// ... the business writes on tx ...
			if err := bus.Publish(outbox.ContextWithTx(ctx, tx), &OrderPlaced{OrderID: 42}); err != nil {
				return err
			}
			if !commit {
				return errors.New("rolled back")
			}
			return nil
		})
		fmt.Println("commit:", commit, "err:", err)
	}
	// Outside a transaction the bus refuses to publish rather than lose the atomic write.
	fmt.Println(errors.Is(bus.Publish(ctx, &OrderPlaced{OrderID: 43}), outbox.ErrNoTx))
	printOutbox(ctx, env.Pool)
	// Output:
	// commit: false err: rolled back
	// commit: true err: <nil>
	// true
	// outbox: orders.placed key=order-42 {"order_id":42}
}

// NewTxPublisher binds a Watermill message.Publisher to one transaction, for code that takes
// a Publisher (a library, a handler written for Watermill) but should write into the outbox.
func ExampleNewTxPublisher() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{NoKafka: true})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()

	err = pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
		pub := outbox.NewTxPublisher(ctx, tx) // Publish is WriteTx on tx; Close does nothing
		return pub.Publish("orders.placed", outbox.NewMessage([]byte(`{"order_id":7}`)))
	})
	fmt.Println(err)
	printOutbox(ctx, env.Pool)
	// Output:
	// <nil>
	// outbox: orders.placed key= {"order_id":7}
}

// printOutbox prints the rows waiting for the relay, oldest first.
func printOutbox(ctx context.Context, pool interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}) {
	rows, err := pool.Query(ctx, `SELECT topic, partition_key, payload FROM onceflow.outbox ORDER BY id`)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var topic, key string
		var payload []byte
		if err := rows.Scan(&topic, &key, &payload); err != nil {
			fmt.Println(err)
			return
		}
		fmt.Printf("outbox: %s key=%s %s\n", topic, key, payload)
	}
}
