package outbox_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/stdlib"

	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
)

// Code written against database/sql writes its events with WriteSQLTx, in the *sql.Tx it
// already has, from any PostgreSQL driver: here pgx's stdlib opened over the service's
// pgxpool (stdlib.OpenDBFromPool), so database/sql code and onceflow share one pool; lib/pq
// (sql.Open("postgres", url)) works the same way. The event commits with the business row, or
// neither does.
func ExampleWriteSQLTx() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{NoKafka: true}) // a throwaway, migrated database
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	db := stdlib.OpenDBFromPool(env.Pool)
	defer db.Close()
	if _, err := db.ExecContext(ctx, `CREATE TABLE orders (id int PRIMARY KEY, status text NOT NULL);
		INSERT INTO orders VALUES (42, 'new'), (43, 'new')`); err != nil {
		fmt.Println(err)
		return
	}

	place := func(id int, payment error) error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback() //nolint:errcheck // a no-op after Commit
		if _, err := tx.ExecContext(ctx, `UPDATE orders SET status = 'placed' WHERE id = $1`, id); err != nil {
			return err
		}
		key := fmt.Sprintf("order-%d", id)
		placed := outbox.SetPartitionKey(outbox.NewMessage(fmt.Appendf(nil, `{"order_id":%d}`, id)), key)
		paid := outbox.SetPartitionKey(outbox.NewMessage(fmt.Appendf(nil, `{"order_id":%d,"paid":true}`, id)), key)
		if err := outbox.WriteSQLTx(ctx, tx, "orders.placed", placed, paid); err != nil { // one statement
			return err
		}
		if payment != nil {
			return payment
		}
		return tx.Commit()
	}
	fmt.Println("order 42:", place(42, nil))
	fmt.Println("order 43:", place(43, errors.New("payment declined")))
	printOutbox(ctx, env.Pool)
	// Output:
	// order 42: <nil>
	// order 43: payment declined
	// outbox: orders.placed key=order-42 {"order_id":42}
	// outbox: orders.placed key=order-42 {"order_id":42,"paid":true}
}
