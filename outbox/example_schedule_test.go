package outbox_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
)

// Schedule a reminder with the order, then cancel it when the order is paid. Both happen in
// the business transactions: the reminder exists only if the order committed, and it is
// withdrawn only if the payment did.
func ExampleDeliverAfter() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{NoKafka: true}) // a throwaway, migrated database
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	pool := env.Pool

	reminder := outbox.SetPartitionKey(outbox.NewMessage([]byte(`{"order_id":42}`)), "order-42")
	outbox.DeliverAfter(reminder, 24*time.Hour) // a relay publishes it tomorrow, unless cancelled
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// ... the order's rows ...
		return outbox.WriteTx(ctx, tx, "orders.reminder", reminder)
	})
	fmt.Println("scheduled:", err)

	var cancelled bool
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
		// ... the payment's rows ...
		cancelled, err = outbox.CancelTx(ctx, tx, reminder.UUID)
		return err
	})
	fmt.Println("cancelled:", cancelled, err)
	// Output:
	// scheduled: <nil>
	// cancelled: true <nil>
}
