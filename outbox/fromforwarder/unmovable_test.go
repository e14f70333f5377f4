package fromforwarder_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox/fromforwarder"
)

// insertDefault writes one envelope into a default-adapter table in its own transaction.
func insertDefault(t *testing.T, db *testdb.DB, table string, env []byte) {
	t.Helper()
	if _, err := db.Pool.Exec(context.Background(), `INSERT INTO `+table+` (uuid, payload, metadata, transaction_id) VALUES ($1, $2, '{}', pg_current_xact_id())`,
		uuid.NewString(), env); err != nil {
		t.Fatal(err)
	}
}

// Every id a Watermill message can carry moves: a ULID, a short UUID and a free-form string
// get UUIDv5(IDNamespace, original) as event id, deterministically; a UUID in upper case keeps
// its value in canonical form; each keeps the original in MetadataOriginalUUID. A payload of
// 2 MiB (over the outbox writer's default 1 MiB) moves whole.
func TestMoveNonUUIDIdsAndLargePayloads(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	// Table names of its own: the activity check matches other sessions by table name, and
	// the package's tests run in parallel in one database.
	table, offsets := db.Schema+".ids_events", db.Schema+".ids_offsets"
	if _, err := db.Pool.Exec(ctx, fmt.Sprintf(defaultDDL, table, "BYTEA", offsets)); err != nil {
		t.Fatal(err)
	}
	upper := strings.ToUpper(uuid.NewString())
	ids := []string{"01ARZ3NDEKTSV4RRFFQ69G5FAV", "vytxeTZskVKR7C7WgdSP3d", "order-42/created", upper, uuid.NewString()}
	big := strings.Repeat("x", 2<<20)
	for i, id := range ids {
		payload := fmt.Sprintf(`{"n":%d}`, i)
		if i == len(ids)-1 {
			payload = big
		}
		insertDefault(t, db, table, envelope(t, "orders", id, "k", payload))
	}
	res, err := fromforwarder.Move(ctx, db.Pool, fromforwarder.Config{Schema: db.Schema, Table: table, OffsetsTable: offsets,
		PartitionKeyMetadata: "kafka_key", CheckWindow: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if res.Moved != len(ids) || res.Remapped != 4 || res.Largest != len(big) || len(res.Skipped) != 0 {
		t.Fatalf("result %+v; want %d moved, 4 remapped, largest %d", res, len(ids), len(big))
	}
	rows := outboxRows(t, db)
	if len(rows) != len(ids) {
		t.Fatalf("%d rows in the outbox, want %d", len(rows), len(ids))
	}
	for i, id := range ids {
		want := id
		switch i {
		case 0, 1, 2:
			want = uuid.NewSHA1(fromforwarder.IDNamespace, []byte(id)).String()
		case 3:
			want = strings.ToLower(id)
		}
		r := rows[i]
		if r.EventID != want || r.Key != "k" || r.Topic != "orders" {
			t.Fatalf("row %d (id %q) = event %s key %q topic %q; want event %s", i, id, r.EventID, r.Key, r.Topic, want)
		}
		if orig := r.Meta[fromforwarder.MetadataOriginalUUID]; (want != id) != (orig == id) || (want == id && orig != "") {
			t.Fatalf("row %d (id %q): original kept as %q", i, id, orig)
		}
	}
	if rows[len(rows)-1].Payload != big {
		t.Fatalf("the 2 MiB payload arrived as %d bytes", len(rows[len(rows)-1].Payload))
	}
}

// A row that cannot be moved (not a forwarder envelope, a payload over MaxPayloadBytes) stops
// the move with an error that names it and the way past it, every time, and moves nothing of
// its batch; with SkipUnmovable the move sets such rows aside in forwarder_move_skipped (the
// envelope kept whole, with the reason), reports them, consumes them like moved rows, and
// moves the rest in order.
func TestMoveSkipsUnmovableRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	table, offsets := db.Schema+".skip_events", db.Schema+".skip_offsets" // names of its own, as above
	if _, err := db.Pool.Exec(ctx, fmt.Sprintf(defaultDDL, table, "BYTEA", offsets)); err != nil {
		t.Fatal(err)
	}
	good1, good2 := uuid.NewString(), uuid.NewString()
	insertDefault(t, db, table, envelope(t, "orders", good1, "", `{"n":1}`))
	insertDefault(t, db, table, envelope(t, "orders", uuid.NewString(), "", strings.Repeat("y", 2000)))
	insertDefault(t, db, table, []byte(`{"not":"an envelope"}`))
	insertDefault(t, db, table, envelope(t, "orders", good2, "", `{"n":2}`))
	cfg := fromforwarder.Config{Schema: db.Schema, Table: table, OffsetsTable: offsets, MaxPayloadBytes: 1000, CheckWindow: time.Millisecond}
	for range 2 { // a rerun meets the same row and says the same
		res, err := fromforwarder.Move(ctx, db.Pool, cfg)
		if err == nil || !strings.Contains(err.Error(), "cannot be moved") || !strings.Contains(err.Error(), "--skip-unmovable") ||
			!strings.Contains(err.Error(), "over the 1000-byte limit") || res.Moved != 0 {
			t.Fatalf("Move = %+v, %v; want the oversized row named and the way past it", res, err)
		}
	}
	if n := len(outboxRows(t, db)); n != 0 {
		t.Fatalf("%d rows moved from a refused batch", n)
	}
	cfg.SkipUnmovable = true
	res, err := fromforwarder.Move(ctx, db.Pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if res.Moved != 2 || len(res.Skipped) != 2 || !strings.Contains(res.Skipped[0].Reason, "over the 1000-byte limit") ||
		!strings.Contains(res.Skipped[1].Reason, "not a forwarder envelope") {
		t.Fatalf("result %+v; want 2 moved and 2 skipped with their reasons", res)
	}
	rows := outboxRows(t, db)
	if len(rows) != 2 || rows[0].EventID != good1 || rows[1].EventID != good2 {
		t.Fatalf("outbox %+v; want the two good rows in order", rows)
	}
	kept, err := db.Pool.Query(ctx, `SELECT envelope, reason FROM `+db.Table("forwarder_move_skipped")+` ORDER BY "offset"`)
	if err != nil {
		t.Fatal(err)
	}
	type skippedRow struct {
		Envelope []byte
		Reason   string
	}
	set, err := pgx.CollectRows(kept, pgx.RowToStructByPos[skippedRow])
	if err != nil {
		t.Fatal(err)
	}
	if len(set) != 2 || string(set[1].Envelope) != `{"not":"an envelope"}` || set[0].Reason != res.Skipped[0].Reason {
		t.Fatalf("forwarder_move_skipped holds %+v", set)
	}
	var e struct {
		Payload []byte `json:"payload"`
	}
	if err := json.Unmarshal(set[0].Envelope, &e); err != nil || len(e.Payload) != 2000 {
		t.Fatalf("the oversized row's envelope was not kept whole: %d bytes, %v", len(e.Payload), err)
	}
	var acked int64
	if err := db.Pool.QueryRow(ctx, `SELECT offset_acked FROM `+offsets).Scan(&acked); err != nil || acked != res.End.Offset {
		t.Fatalf("forwarder offset %d (%v), want %d", acked, err, res.End.Offset)
	}
	if res, err := fromforwarder.Move(ctx, db.Pool, cfg); err != nil || res.Moved != 0 || len(res.Skipped) != 0 {
		t.Fatalf("rerun: %+v, %v; want nothing left", res, err)
	}
}

// waitLog is a slog handler that signals the move's "waiting" line.
type waitLog struct{ waiting chan string }

func (h waitLog) Enabled(context.Context, slog.Level) bool { return true }
func (h waitLog) Handle(_ context.Context, r slog.Record) error {
	if r.Message == "fromforwarder waiting" {
		var what string
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "for" {
				what = a.Value.String()
			}
			return true
		})
		select {
		case h.waiting <- what:
		default:
		}
	}
	return nil
}
func (h waitLog) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h waitLog) WithGroup(string) slog.Handler      { return h }

// A transaction that began before the move but writes its row only afterwards — so it had no
// transaction id when the move started, and gets one newer than any the move saw — is waited
// for: the move does not report the table drained until it ended, then moves its row. For the
// queue adapter its row has a lower offset than the rows moved before it, and the printed way
// back (RollbackSQL) still hands every moved row back to the forwarder.
//
// Not parallel: the held transaction is open in the database every test shares, so the other
// tests' moves would wait for it too, as they should.
func TestMoveWaitsForTransactionsThatBeganBeforeIt(t *testing.T) {
	for _, adapter := range []string{fromforwarder.AdapterDefault, fromforwarder.AdapterQueue} {
		t.Run(adapter, func(t *testing.T) {
			ctx := context.Background()
			db := testdb.New(t)
			table, offsets := db.Schema+".watermill_forwarder_topic", db.Schema+".watermill_offsets_forwarder_topic"
			ddl := fmt.Sprintf(defaultDDL, table, "JSON", offsets)
			insert := `INSERT INTO ` + table + ` (uuid, payload, metadata, transaction_id) VALUES ($1, $2, '{}', pg_current_xact_id())`
			if adapter == fromforwarder.AdapterQueue {
				ddl, insert = fmt.Sprintf(queueDDL, table), `INSERT INTO `+table+` (uuid, payload, metadata) VALUES ($1, $2, '{}')`
			}
			if _, err := db.Pool.Exec(ctx, ddl); err != nil {
				t.Fatal(err)
			}
			// The late producer begins: no write yet, so no transaction id.
			late, err := db.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = late.Rollback(ctx) }()
			if _, err := late.Exec(ctx, `SELECT 1`); err != nil {
				t.Fatal(err)
			}
			var lateXid *string
			if err := late.QueryRow(ctx, `SELECT pg_current_xact_id_if_assigned()::text`).Scan(&lateXid); err != nil || lateXid != nil {
				t.Fatalf("the late transaction has a transaction id already (%v, %v)", lateXid, err)
			}
			lateID := uuid.NewString()
			if adapter == fromforwarder.AdapterQueue {
				// It takes its offset now (the lowest), its transaction id with it, and
				// commits last.
				if _, err := late.Exec(ctx, insert, uuid.NewString(), envelope(t, "orders", lateID, "", `{"late":true}`)); err != nil {
					t.Fatal(err)
				}
			}
			for i := range 3 {
				if _, err := db.Pool.Exec(ctx, insert, uuid.NewString(), envelope(t, "orders", uuid.NewString(), "", fmt.Sprintf(`{"n":%d}`, i))); err != nil {
					t.Fatal(err)
				}
			}
			log := waitLog{waiting: make(chan string, 1)}
			type out struct {
				res fromforwarder.Result
				err error
			}
			done := make(chan out, 1)
			go func() {
				res, err := fromforwarder.Move(ctx, db.Pool, fromforwarder.Config{Schema: db.Schema, Adapter: adapter, Table: table, OffsetsTable: offsets,
					CheckWindow: time.Millisecond, WaitOpenTransactions: time.Minute, Logger: slog.New(log)})
				done <- out{res, err}
			}()
			select {
			case o := <-done:
				t.Fatalf("Move returned (%+v, %v) while a transaction that began before it was still open", o.res, o.err)
			case what := <-log.waiting:
				if !strings.Contains(what, "began before the move") {
					t.Fatalf("the move waits for %q", what)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("the move neither finished nor waited")
			}
			if n := len(outboxRows(t, db)); n != 3 {
				t.Fatalf("%d rows moved before the late commit, want 3", n)
			}
			if adapter == fromforwarder.AdapterDefault {
				if _, err := late.Exec(ctx, insert, uuid.NewString(), envelope(t, "orders", lateID, "", `{"late":true}`)); err != nil {
					t.Fatal(err)
				}
			}
			if err := late.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			var o out
			select {
			case o = <-done:
			case <-time.After(time.Minute):
				t.Fatal("the move did not finish after the late transaction committed")
			}
			rows := outboxRows(t, db)
			if o.err != nil || o.res.Moved != 4 || len(rows) != 4 || rows[3].EventID != lateID {
				t.Fatalf("Move = %+v, %v, outbox %+v; want the late row moved after the others", o.res, o.err, rows)
			}
			if adapter == fromforwarder.AdapterQueue {
				if _, err := db.Pool.Exec(ctx, o.res.RollbackSQL); err != nil {
					t.Fatalf("rollback %q: %v", o.res.RollbackSQL, err)
				}
				var unacked int
				if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+table+` WHERE NOT acked`).Scan(&unacked); err != nil || unacked != 4 {
					t.Fatalf("after the printed rollback %q, %d rows are pending again (%v); want all 4 moved rows", o.res.RollbackSQL, unacked, err)
				}
			}
		})
	}
}
