package onceflowtest_test

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
)

// Start gives an Example or a local program a migrated database and a Kafka cluster with its
// topics, on the installed PostgreSQL binaries and an in-process Kafka (or on DATABASE_URL and
// KAFKA_BROKERS), and Close removes them.
func ExampleStart() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{
		Kafka: onceflowtest.KafkaOptions{Topics: []string{"orders.placed"}},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()

	// The database is migrated as `onceflow migrate up` leaves it: defaults just work.
	err = pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
		return outbox.WriteTx(ctx, tx, "orders.placed", outbox.NewMessage([]byte(`{"order_id":42}`)))
	})
	var pending int
	_ = env.Pool.QueryRow(ctx, `SELECT count(*) FROM onceflow.outbox`).Scan(&pending)
	fmt.Println("write:", err, "pending:", pending, "brokers:", len(env.Brokers))
	// Output:
	// write: <nil> pending: 1 brokers: 1
}
