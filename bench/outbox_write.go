package main

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
)

// benchPayload is the ~200 B event body every scenario uses.
var benchPayload = []byte(`{"order_id":"0193a5d2-7c4e-7b1a-9f00-1234567890ab","customer_id":"c-1029384756","items":[{"sku":"SKU-000123","qty":2,"price_cents":1999},{"sku":"SKU-000456","qty":1,"price_cents":4999}],"total_cents":8997,"currency":"EUR"}`)

// benchOutboxWrite: 20,000 events written 100 per transaction by one writer, 50 keys.
func benchOutboxWrite(ctx context.Context, e *env) ([]result, error) {
	pool, schema, err := e.freshSchema(ctx, "write")
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	w, err := outbox.NewWriter(outbox.Config{Schema: schema})
	if err != nil {
		return nil, err
	}
	const total, perTx = 20000, 100
	start := time.Now()
	if err := writeEvents(ctx, pool, w, "bench", total, perTx, 50); err != nil {
		return nil, err
	}
	rate := float64(total) / time.Since(start).Seconds()
	return []result{{Scenario: "outbox_write", System: "onceflow", Value: rate, Unit: "ev/s", HigherIsBetter: true}}, nil
}

// writeEvents writes total events in transactions of perTx, spread over keys partition keys.
func writeEvents(ctx context.Context, pool interface {
	Begin(context.Context) (pgx.Tx, error)
}, w *outbox.Writer, topic string, total, perTx, keys int) error {
	for n := 0; n < total; n += perTx {
		batch := make([]*message.Message, 0, perTx)
		for i := n; i < n+perTx && i < total; i++ {
			batch = append(batch, outbox.SetPartitionKey(outbox.NewMessage(benchPayload), keyName(i%keys)))
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		if err := w.WriteTx(ctx, tx, topic, batch...); err != nil {
			tx.Rollback(ctx)
			return err
		}
		if err := tx.Commit(ctx); err != nil {
			return err
		}
	}
	return nil
}

func keyName(i int) string { return "key-" + string(rune('a'+i%26)) + string(rune('a'+i/26%26)) }
