package inbox_test

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
)

// A set-based batch handler: one INSERT … SELECT FROM unnest for the batch's new messages
// (duplicates are removed before it runs), in the batch's transaction with their dedup rows.
// inboxkafka.BatchConsumer calls ProcessBatch with the messages one poll returned for a
// partition; here it is called directly, with a message delivered twice.
func ExampleInbox_BatchFunc() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{NoKafka: true})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	pool := env.Pool
	if _, err := pool.Exec(ctx, `CREATE TABLE invoice_request (event_id text PRIMARY KEY, payload bytea NOT NULL)`); err != nil {
		fmt.Println(err)
		return
	}
	ib, err := inbox.New(inbox.Config{Pool: pool, Consumer: "billing"})
	if err != nil {
		fmt.Println(err)
		return
	}
	invoices := ib.BatchFunc("billing.invoiced", func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) ([]*message.Message, error) {
		ids, payloads := make([]string, len(msgs)), make([][]byte, len(msgs))
		for i, m := range msgs {
			ids[i], payloads[i] = m.UUID, m.Payload
		}
		if _, err := tx.Exec(ctx, `INSERT INTO invoice_request (event_id, payload) SELECT * FROM unnest($1::text[], $2::bytea[])`, ids, payloads); err != nil {
			return nil, err // or &inbox.MessageError{Index: i, Err: err} when it knows which message failed
		}
		// One event per invoice, written to the outbox in the same transaction.
		out := make([]*message.Message, len(msgs))
		for i, m := range msgs {
			out[i] = outbox.NewMessage(m.Payload)
		}
		return out, nil
	})
	a, b := outbox.NewMessage([]byte(`{"order":1}`)), outbox.NewMessage([]byte(`{"order":2}`))
	err = invoices.ProcessBatch(ctx, []*message.Message{a, b, a.Copy()})
	var requests, events int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM invoice_request`).Scan(&requests)
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM onceflow.outbox WHERE topic = 'billing.invoiced'`).Scan(&events)
	fmt.Println("batch:", err, "requests:", requests, "events:", events)
	// Output:
	// batch: <nil> requests: 2 events: 2
}
