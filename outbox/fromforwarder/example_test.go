package fromforwarder_test

import (
	"context"
	"fmt"
	"time"

	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox/fromforwarder"
)

// Move the events a stopped Watermill forwarder had not published yet into the outbox. Here
// the forwarder's table (watermill-sql's default PostgreSQL adapter, forwarder topic
// "forwarder_topic") holds two envelopes, the first already forwarded; `onceflow migrate
// from-forwarder` does the same from the command line.
func ExampleMove() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{NoKafka: true}) // a throwaway, migrated database
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	pool := env.Pool
	// What watermill-sql created and the forwarder's publisher wrote.
	if _, err := pool.Exec(ctx, fmt.Sprintf(defaultDDL, `"watermill_forwarder_topic"`, "JSON", `"watermill_offsets_forwarder_topic"`)+`;
		INSERT INTO watermill_forwarder_topic (uuid, payload, transaction_id) VALUES
		  ('7c4e1d8a-0000-4000-8000-000000000001', '{"destination_topic":"orders","uuid":"0193a5d2-7c4e-7b1a-9f00-000000000001","payload":"eyJuIjoxfQ==","metadata":{"partition_key":"order-1"}}', pg_current_xact_id());
		INSERT INTO watermill_forwarder_topic (uuid, payload, transaction_id) VALUES
		  ('7c4e1d8a-0000-4000-8000-000000000002', '{"destination_topic":"orders","uuid":"0193a5d2-7c4e-7b1a-9f00-000000000002","payload":"eyJuIjoyfQ==","metadata":{"partition_key":"order-1"}}', pg_current_xact_id());
		INSERT INTO watermill_offsets_forwarder_topic SELECT '', "offset", transaction_id FROM watermill_forwarder_topic ORDER BY "offset" LIMIT 1;`); err != nil {
		fmt.Println(err)
		return
	}

	res, err := fromforwarder.Move(ctx, pool, fromforwarder.Config{CheckWindow: 100 * time.Millisecond}) // the defaults match the forwarder's
	fmt.Println("moved:", res.Moved, err)
	var id, topic, key, payload string
	_ = pool.QueryRow(ctx, `SELECT event_id::text, topic, partition_key, convert_from(payload, 'UTF8') FROM onceflow.outbox`).Scan(&id, &topic, &key, &payload)
	fmt.Println(id, topic, key, payload)
	res, err = fromforwarder.Move(ctx, pool, fromforwarder.Config{CheckWindow: 100 * time.Millisecond})
	fmt.Println("moved again:", res.Moved, "over every run:", res.TotalMoved, err)
	// Output:
	// moved: 1 <nil>
	// 0193a5d2-7c4e-7b1a-9f00-000000000002 orders order-1 {"n":2}
	// moved again: 0 over every run: 1 <nil>
}
