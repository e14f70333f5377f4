package fromforwarder_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox/fromforwarder"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// The DDL of watermill-sql v4's PostgreSQL adapters (the end-to-end test in internal/adopttest
// uses watermill-sql itself; these tests need no dependency).
const (
	defaultDDL = `CREATE TABLE %s ("offset" BIGSERIAL, "uuid" VARCHAR(36) NOT NULL, "created_at" TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
		"payload" %s DEFAULT NULL, "metadata" JSON DEFAULT NULL, "transaction_id" xid8 NOT NULL, PRIMARY KEY ("transaction_id", "offset"));
		CREATE TABLE %s (consumer_group VARCHAR(255) NOT NULL, offset_acked BIGINT, last_processed_transaction_id xid8 NOT NULL, PRIMARY KEY(consumer_group))`
	queueDDL = `CREATE TABLE %s ("offset" SERIAL PRIMARY KEY, "uuid" VARCHAR(36) NOT NULL, "payload" JSON DEFAULT NULL,
		"metadata" JSON DEFAULT NULL, "acked" BOOLEAN NOT NULL DEFAULT FALSE, "created_at" TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT CURRENT_TIMESTAMP)`
)

// envelope is what Watermill's forwarder publisher stores.
func envelope(t *testing.T, topic, id, key string, payload string) []byte {
	t.Helper()
	md := map[string]string{"origin": "test"}
	if key != "" {
		md["kafka_key"] = key
	}
	b, err := json.Marshal(map[string]any{"destination_topic": topic, "uuid": id, "payload": []byte(payload), "metadata": md})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

type outRow struct {
	EventID, Topic, Key, Payload string
	Meta                         map[string]string
}

func outboxRows(t *testing.T, db *testdb.DB) []outRow {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), `SELECT event_id::text, topic, partition_key, convert_from(payload, 'UTF8'), metadata FROM `+db.Table("outbox")+` ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (outRow, error) {
		var x outRow
		return x, r.Scan(&x.EventID, &x.Topic, &x.Key, &x.Payload, &x.Meta)
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// Custom table names (schema-qualified, as GenerateMessagesTableName may give), a bytea
// payload column, a consumer group that already consumed part of the table: only the rest
// moves, in (transaction, offset) order, with UUIDs, metadata and the key from the configured
// metadata entry; the group's offset ends at the last row; a second run moves nothing.
func TestMoveDefaultAdapterCustomNames(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	table, offsets := db.Schema+`."My Events"`, db.Schema+".my_offsets"
	if _, err := db.Pool.Exec(ctx, fmt.Sprintf(defaultDDL, table, "BYTEA", offsets)); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for i := range 12 {
		id := uuid.NewString()
		ids = append(ids, id)
		if _, err := db.Pool.Exec(ctx, `INSERT INTO `+table+` (uuid, payload, metadata, transaction_id) VALUES ($1, $2, '{}', pg_current_xact_id())`,
			uuid.NewString(), envelope(t, []string{"a", "b"}[i%2], id, fmt.Sprintf("k%d", i%3), fmt.Sprintf(`{"n":%d}`, i))); err != nil {
			t.Fatal(err)
		}
	}
	// The group consumed the first 4 rows.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+offsets+` SELECT 'billing', "offset", transaction_id FROM `+table+` ORDER BY transaction_id, "offset" OFFSET 3 LIMIT 1`); err != nil {
		t.Fatal(err)
	}
	cfg := fromforwarder.Config{Schema: db.Schema, Table: table, OffsetsTable: offsets, ConsumerGroup: "billing",
		PartitionKeyMetadata: "kafka_key", BatchSize: 5, CheckWindow: 10 * time.Millisecond}

	dry := cfg
	dry.DryRun = true
	res, err := fromforwarder.Move(ctx, db.Pool, dry)
	if err != nil || res.Moved != 8 || len(outboxRows(t, db)) != 0 {
		t.Fatalf("dry run: %+v, %v", res, err)
	}
	res, err = fromforwarder.Move(ctx, db.Pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if res.Moved != 8 || res.Batches != 2 || res.Topics["a"] != 4 || res.Topics["b"] != 4 || res.FirstID != ids[4] || res.LastID != ids[11] {
		t.Fatalf("result %+v", res)
	}
	rows := outboxRows(t, db)
	for i, r := range rows {
		n := i + 4
		want := outRow{EventID: ids[n], Topic: []string{"a", "b"}[n%2], Key: fmt.Sprintf("k%d", n%3), Payload: fmt.Sprintf(`{"n":%d}`, n)}
		if r.EventID != want.EventID || r.Topic != want.Topic || r.Key != want.Key || r.Payload != want.Payload || r.Meta["origin"] != "test" {
			t.Fatalf("row %d = %+v, want %+v", i, r, want)
		}
	}
	if len(rows) != 8 {
		t.Fatalf("%d rows moved", len(rows))
	}
	var acked int64
	if err := db.Pool.QueryRow(ctx, `SELECT offset_acked FROM `+offsets+` WHERE consumer_group = 'billing'`).Scan(&acked); err != nil || acked != res.End.Offset {
		t.Fatalf("offset %d (%v), want %d", acked, err, res.End.Offset)
	}
	if !strings.Contains(res.RollbackSQL, "my_offsets") || res.Start.Offset == 0 {
		t.Fatalf("rollback %q from %+v", res.RollbackSQL, res.Start)
	}
	if res, err := fromforwarder.Move(ctx, db.Pool, cfg); err != nil || res.Moved != 0 {
		t.Fatalf("second run: %+v, %v", res, err)
	}
	// The rollback statement puts the forwarder back where it was.
	if _, err := db.Pool.Exec(ctx, res.RollbackSQL); err != nil {
		t.Fatal(err)
	}
	dry.DryRun = true
	if res, err := fromforwarder.Move(ctx, db.Pool, dry); err != nil || res.Moved != 8 {
		t.Fatalf("after rollback: %+v, %v", res, err)
	}
	// docs/operations.md's rollback removes the moved rows from the outbox (bytea variant).
	tag, err := db.Pool.Exec(ctx, `DELETE FROM `+db.Table("outbox")+` o USING `+table+` w
		WHERE o.event_id::text = convert_from(w.payload, 'UTF8')::jsonb->>'uuid'`)
	if err != nil || tag.RowsAffected() != 8 {
		t.Fatalf("rollback delete: %v, %v", tag, err)
	}
}

// Queue adapter: unacked rows move and are marked acked (or deleted with Delete); acked rows
// stay where they are. A row that is not a forwarder envelope fails its batch, which moves
// nothing, and the batches before it stay moved.
func TestMoveQueueAdapter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, del := range []bool{false, true} {
		t.Run(fmt.Sprint("delete=", del), func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t)
			table := db.Schema + ".watermill_forwarder_topic"
			if _, err := db.Pool.Exec(ctx, fmt.Sprintf(queueDDL, table)); err != nil {
				t.Fatal(err)
			}
			for i := range 7 {
				if _, err := db.Pool.Exec(ctx, `INSERT INTO `+table+` (uuid, payload, metadata, acked) VALUES ($1, $2, '{}', $3)`,
					uuid.NewString(), envelope(t, "orders", uuid.NewString(), "", fmt.Sprintf(`{"n":%d}`, i)), i < 2); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := db.Pool.Exec(ctx, `INSERT INTO `+table+` (uuid, payload, metadata) VALUES ($1, '{"not":"an envelope"}', '{}')`, uuid.NewString()); err != nil {
				t.Fatal(err)
			}
			cfg := fromforwarder.Config{Schema: db.Schema, Adapter: fromforwarder.AdapterQueue, Table: table, Delete: del, BatchSize: 3, CheckWindow: time.Millisecond}
			res, err := fromforwarder.Move(ctx, db.Pool, cfg)
			if err == nil || !strings.Contains(err.Error(), "not a forwarder envelope") || res.Moved != 3 {
				t.Fatalf("Move = %+v, %v; want 3 moved, then the bad row refused", res, err)
			}
			var left, acked int
			if err := db.Pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE acked) FROM `+table).Scan(&left, &acked); err != nil {
				t.Fatal(err)
			}
			wantLeft, wantAcked := 8, 5
			if del {
				wantLeft, wantAcked = 5, 2
			}
			if left != wantLeft || acked != wantAcked || len(outboxRows(t, db)) != 3 {
				t.Fatalf("table %d rows (%d acked), outbox %d; want %d (%d), 3", left, acked, len(outboxRows(t, db)), wantLeft, wantAcked)
			}
			// The operator fixes the row and runs again: the rest moves, the bookkeeping
			// adds up over both runs and keeps the first run's start.
			if _, err := db.Pool.Exec(ctx, `UPDATE `+table+` SET payload = $1 WHERE payload::text LIKE '%not%'`,
				envelope(t, "orders", uuid.NewString(), "", `{"fixed":true}`)); err != nil {
				t.Fatal(err)
			}
			res, err = fromforwarder.Move(ctx, db.Pool, cfg)
			if err != nil || res.Moved != 3 || res.TotalMoved != 6 || res.Start.Offset != 3 || len(outboxRows(t, db)) != 6 {
				t.Fatalf("rerun: %+v, %v", res, err)
			}
			if del != (res.RollbackSQL == "") {
				t.Fatalf("rollback %q with delete=%v", res.RollbackSQL, del)
			}
		})
	}
}

// Bad configuration is refused at once, every problem named.
func TestMoveConfigErrors(t *testing.T) {
	t.Parallel()
	_, err := fromforwarder.Move(context.Background(), nil, fromforwarder.Config{Adapter: "mysql", BatchSize: -1,
		Table: "x; DROP TABLE y", Schema: "Bad Schema"})
	for _, want := range []string{"Adapter", "BatchSize", "Table", "schema"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("err = %v, want it to name %s", err, want)
		}
	}
	_, err = fromforwarder.Move(context.Background(), nil, fromforwarder.Config{Adapter: fromforwarder.AdapterQueue, ConsumerGroup: "g"})
	if err == nil || !strings.Contains(err.Error(), "ConsumerGroup") {
		t.Fatalf("err = %v", err)
	}
	if errors.Is(err, fromforwarder.ErrForwarderRunning) {
		t.Fatal("a config error is not ErrForwarderRunning")
	}
}

// A forwarder that runs anyway (the check skipped with Force) and the move never both take a
// row: a batch waits for the forwarder's lock on the offset row, then reads on from the
// position the forwarder committed.
//
// Not parallel: its open forwarder transaction holds back the cluster-wide transaction horizon
// (pg_snapshot_xmin), behind which the other tests' moves would wait, as the forwarder does.
func TestMoveInterlocksWithARunningForwarder(t *testing.T) {
	ctx := context.Background()
	db := testdb.New(t)
	table, offsets := db.Schema+".watermill_forwarder_topic", db.Schema+".watermill_offsets_forwarder_topic"
	if _, err := db.Pool.Exec(ctx, fmt.Sprintf(defaultDDL, table, "JSON", offsets)); err != nil {
		t.Fatal(err)
	}
	for i := range 6 {
		if _, err := db.Pool.Exec(ctx, `INSERT INTO `+table+` (uuid, payload, metadata, transaction_id) VALUES ($1, $2, '{}', pg_current_xact_id())`,
			uuid.NewString(), envelope(t, "orders", uuid.NewString(), "k", fmt.Sprintf(`{"n":%d}`, i))); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+offsets+` VALUES ('', 0, '0')`); err != nil {
		t.Fatal(err)
	}
	// The forwarder's subscriber: it holds the offset row while it publishes two rows.
	fwd, err := db.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = fwd.Rollback(ctx) }()
	if _, err := fwd.Exec(ctx, `SELECT * FROM `+offsets+` WHERE consumer_group = '' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	type out struct {
		res fromforwarder.Result
		err error
	}
	done := make(chan out, 1)
	go func() {
		res, err := fromforwarder.Move(ctx, db.Pool, fromforwarder.Config{Schema: db.Schema, Table: table, OffsetsTable: offsets, Force: true})
		done <- out{res, err}
	}()
	// Wait until the move waits for the lock, then the forwarder acks rows 1-2 and commits.
	deadline := time.Now().Add(30 * time.Second)
	for {
		var waiting bool
		if err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%FOR UPDATE%' AND datname = current_database())`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the move never waited for the forwarder's lock")
		}
		time.Sleep(5 * time.Millisecond) // polling pg_stat_activity: no signal for a lock wait
	}
	if _, err := fwd.Exec(ctx, `UPDATE `+offsets+` SET (offset_acked, last_processed_transaction_id) =
		(SELECT "offset", transaction_id FROM `+table+` ORDER BY transaction_id, "offset" OFFSET 1 LIMIT 1) WHERE consumer_group = ''`); err != nil {
		t.Fatal(err)
	}
	if err := fwd.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	o := <-done
	if o.err != nil || o.res.Moved != 4 || len(outboxRows(t, db)) != 4 {
		t.Fatalf("Move = %+v, %v; want the 4 rows the forwarder did not take", o.res, o.err)
	}
	if p := outboxRows(t, db)[0].Payload; p != `{"n":2}` {
		t.Fatalf("first moved row %s, want n=2", p)
	}
}
