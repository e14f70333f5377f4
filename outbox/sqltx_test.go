package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
)

// sqlDB opens database/sql (pgx's stdlib) over the test database's pool.
func sqlDB(t *testing.T, db *testdb.DB) *sql.DB {
	t.Helper()
	sdb := stdlib.OpenDBFromPool(db.Pool)
	t.Cleanup(func() { _ = sdb.Close() })
	return sdb
}

// awkwardMessages are messages whose values an array literal must escape: quotes,
// backslashes, braces, commas, NUL and high bytes in payloads, empty payloads and keys.
func awkwardMessages() []*message.Message {
	msgs := []*message.Message{
		outbox.SetPartitionKey(outbox.NewMessage([]byte(`{"a":"b"}`)), `key "quoted", {braced}`),
		outbox.SetPartitionKey(outbox.NewMessage([]byte{0, 1, 2, '\\', '"', 0xff, '{', '}', ','}), `back\slash`),
		outbox.NewMessage([]byte{}), // no key, empty payload
		outbox.SetPartitionKey(outbox.NewMessage([]byte("NULL")), "NULL"),
		outbox.SetPartitionKey(outbox.NewMessage([]byte("ünïcode ✓")), "ключ"),
	}
	msgs[0].Metadata.Set("note", `with "quotes" and \ backslash`)
	return msgs
}

func cloneMessages(msgs []*message.Message) []*message.Message {
	out := make([]*message.Message, len(msgs))
	for i, m := range msgs {
		out[i] = m.Copy()
	}
	return out
}

// readAll returns the rows without their ids (which differ between two schemas).
func readAll(t *testing.T, db *testdb.DB) []row {
	rows := readRows(t, db)
	for i := range rows {
		rows[i].ID = 0
	}
	return rows
}

// The database/sql path runs the same statements as the pgx path and stores identical rows:
// the same ids, topics, keys (and key hashes), payload bytes and metadata, in the same order,
// for each shape of the statement (one message, several on one topic, several topics) and
// with and without the wake-up check.
func TestWriteSQLTxStoresWhatWriteTxStores(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		topic  string
		routed bool
		n      int
	}{
		{name: "one", topic: "orders", n: 1},
		{name: "many", topic: "orders", n: 5},
		{name: "routed", topic: "", routed: true, n: 5},
	} {
		for _, notify := range []bool{false, true} {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				msgs := awkwardMessages()[:tc.n]
				if tc.routed {
					for i, m := range msgs {
						outbox.ToTopic(m, []string{"a", "b", `c"d`}[i%3])
					}
				}
				viaPgx, viaSQL := testdb.New(t), testdb.New(t)
				wp := newWriter(t, viaPgx, outbox.Config{DisableNotify: !notify})
				ws := newWriter(t, viaSQL, outbox.Config{DisableNotify: !notify})
				if err := pgx.BeginFunc(ctx, viaPgx.Pool, func(tx pgx.Tx) error {
					return wp.WriteTx(ctx, tx, tc.topic, cloneMessages(msgs)...)
				}); err != nil {
					t.Fatal(err)
				}
				sdb := sqlDB(t, viaSQL)
				tx, err := sdb.BeginTx(ctx, nil)
				if err != nil {
					t.Fatal(err)
				}
				if err := ws.WriteSQLTx(ctx, tx, tc.topic, cloneMessages(msgs)...); err != nil {
					t.Fatal(err)
				}
				if err := tx.Commit(); err != nil {
					t.Fatal(err)
				}
				got, want := readAll(t, viaSQL), readAll(t, viaPgx)
				if len(want) != tc.n || !reflect.DeepEqual(got, want) {
					t.Fatalf("database/sql rows differ from pgx rows:\n got %+v\nwant %+v", got, want)
				}
				hash := func(db *testdb.DB) []int64 {
					rows, err := db.Pool.Query(ctx, `SELECT key_hash FROM `+db.Table("outbox")+` ORDER BY id`)
					if err != nil {
						t.Fatal(err)
					}
					h, err := pgx.CollectRows(rows, pgx.RowTo[int64])
					if err != nil {
						t.Fatal(err)
					}
					return h
				}
				if g, w := hash(viaSQL), hash(viaPgx); !reflect.DeepEqual(g, w) {
					t.Fatalf("key hashes differ: %v vs %v", g, w)
				}
			})
		}
	}
}

// Atomic write on database/sql: a rolled-back *sql.Tx leaves no row; invalid input writes
// nothing and says why; a schema without the outbox says which command to run.
func TestWriteSQLTxAtomicAndErrors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	w := newWriter(t, db, outbox.Config{})
	sdb := sqlDB(t, db)

	tx, err := sdb.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.WriteSQLTx(ctx, tx, "orders", outbox.NewMessage([]byte("lost"))); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	if rows := readRows(t, db); len(rows) != 0 {
		t.Fatalf("rolled back write left %d rows", len(rows))
	}

	tx, err = sdb.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	bad := message.NewMessage("not-a-uuid", []byte("x"))
	err = w.WriteSQLTx(ctx, tx, "orders", outbox.NewMessage([]byte("ok")), bad)
	var ve *outbox.ValidationError
	if !errors.As(err, &ve) || ve.Index != 1 || !errors.Is(err, outbox.ErrInvalidUUID) {
		t.Fatalf("err = %v, want a ValidationError for message 1", err)
	}

	other, err := outbox.NewWriter(outbox.Config{Schema: "no_such_schema_" + strings.ToLower(t.Name()[:4])})
	if err != nil {
		t.Fatal(err)
	}
	err = other.WriteSQLTx(ctx, tx, "orders", outbox.NewMessage([]byte("x")))
	if err == nil || !strings.Contains(err.Error(), "onceflow migrate up") {
		t.Fatalf("err = %v, want advice to run onceflow migrate up", err)
	}

	if err := w.WriteSQLTx(ctx, nil, "orders", outbox.NewMessage([]byte("x"))); err == nil {
		t.Fatal("a nil *sql.Tx was accepted")
	}
}
