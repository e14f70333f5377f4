package outbox_test

import (
	"context"
	"fmt"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/outbox"
)

// Write a domain event in the same transaction as the business row: both commit or neither.
func ExampleWriteTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `UPDATE orders SET status = 'placed' WHERE id = $1`, 42); err != nil {
			return err
		}
		evt := outbox.SetPartitionKey(outbox.NewMessage([]byte(`{"order_id":42}`)), "order-42")
		return outbox.WriteTx(ctx, tx, "orders.placed", evt)
	})
	if err != nil {
		fmt.Println(err)
	}
}
