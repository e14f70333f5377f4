package outbox_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
)

// Write a domain event in the same transaction as the business row: both commit or neither.
// In a service the pool comes from pgxpool.New(ctx, os.Getenv("DATABASE_URL")), on a
// database migrated with `onceflow migrate up`.
func ExampleWriteTx() {
	ctx := context.Background()
	pool, done := testdb.NewDatabase() // a throwaway database with the onceflow schema migrated
	defer done()
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
	rows, _ := pool.Query(ctx, `SELECT topic, partition_key, payload FROM onceflow.outbox ORDER BY id`)
	for rows.Next() {
		var topic, key string
		var payload []byte
		_ = rows.Scan(&topic, &key, &payload)
		fmt.Printf("outbox: %s key=%s %s\n", topic, key, payload)
	}
	// Output:
	// order 42: <nil>
	// order 43: payment declined
	// outbox: orders.placed key=order-42 {"order_id":42}
}
