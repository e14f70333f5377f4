package adopttest

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/lib/pq" // database/sql driver "postgres"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

// openLibPQ opens the test database with lib/pq, the driver most watermill-sql services use.
func openLibPQ(t *testing.T, db *testdb.DB) *sql.DB {
	t.Helper()
	url := db.URL
	if !strings.Contains(url, "sslmode=") { // lib/pq defaults to sslmode=require
		sep := "?"
		if strings.Contains(url, "?") {
			sep = "&"
		}
		url += sep + "sslmode=disable"
	}
	sdb, err := sql.Open("postgres", url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sdb.Close() })
	return sdb
}

// WriteSQLTx on lib/pq: arrays travel as literals lib/pq can send; the rows are those the
// pgx path writes (outbox's TestWriteSQLTxStoresWhatWriteTxStores compares pgx's stdlib
// with pgx), with awkward keys and payload bytes; a rollback leaves nothing; the missing
// schema error is recognised from lib/pq's error type.
func TestWriteSQLTxWithLibPQ(t *testing.T) {
	ctx := context.Background()
	db := testdb.New(t)
	sdb := openLibPQ(t, db)
	for _, notify := range []bool{false, true} {
		w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema, DisableNotify: !notify})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := db.Pool.Exec(ctx, `DELETE FROM `+db.Table("outbox")); err != nil {
			t.Fatal(err)
		}
		msgs := []*message.Message{
			outbox.SetPartitionKey(outbox.NewMessage([]byte{0, 1, '\\', '"', 0xff, '{', ','}), `k "1", {x}`),
			outbox.ToTopic(outbox.SetPartitionKey(outbox.NewMessage([]byte{}), `back\slash`), "other"),
			outbox.NewMessage([]byte("ünïcode")),
		}
		msgs[0].Metadata.Set("note", `"quoted" \ meta`)
		for _, batch := range [][]*message.Message{msgs[:1], {msgs[0].Copy(), msgs[2].Copy()}, msgs} {
			tx, err := sdb.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := w.WriteSQLTx(ctx, tx, "orders", batch...); err != nil {
				t.Fatal(err)
			}
			if err := tx.Rollback(); err != nil {
				t.Fatal(err)
			}
		}
		tx, err := sdb.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.WriteSQLTx(ctx, tx, "orders", msgs...); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		rows, err := db.Pool.Query(ctx, `SELECT event_id::text, topic, partition_key, payload, metadata FROM `+db.Table("outbox")+` ORDER BY id`)
		if err != nil {
			t.Fatal(err)
		}
		i := 0
		for rows.Next() {
			var id, topic, key string
			var payload []byte
			var md map[string]string
			if err := rows.Scan(&id, &topic, &key, &payload, &md); err != nil {
				t.Fatal(err)
			}
			m := msgs[i]
			if id != m.UUID || topic != outbox.TopicOf(m, "orders") || key != outbox.PartitionKey(m) || string(payload) != string(m.Payload) ||
				md["note"] != m.Metadata.Get("note") {
				t.Fatalf("row %d: %s %s %q %q %v; want message %v", i, id, topic, key, payload, md, m)
			}
			i++
		}
		if rows.Err() != nil || i != len(msgs) {
			t.Fatalf("%d rows (%v), want %d (rolled-back writes must leave none)", i, rows.Err(), len(msgs))
		}
	}

	bad, err := outbox.NewWriter(outbox.Config{Schema: "no_such_schema"})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := sdb.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if err := bad.WriteSQLTx(ctx, tx, "orders", outbox.NewMessage([]byte("x"))); err == nil || !strings.Contains(err.Error(), "onceflow migrate up") {
		t.Fatalf("err = %v, want advice to run onceflow migrate up", err)
	}
}

type order struct {
	ID string `json:"id"`
}

// StartSQLTx on lib/pq: the saga row, its timers and its first command commit with the
// business row; a retried start is a no-op; another definition's id is ErrIDInUse.
func TestStartSQLTxWithLibPQ(t *testing.T) {
	ctx := context.Background()
	db := testdb.New(t)
	sdb := openLibPQ(t, db)
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	def, err := saga.Define("checkout", 1, []*saga.StepDef[order]{
		saga.Step[order]("reserve").Send("cmd.reserve", func(o order) (any, error) { return o, nil }).Timeout(time.Minute),
	}, saga.WithDeadline(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	other, err := saga.Define("other", 1, []*saga.StepDef[order]{
		saga.Step[order]("x").Send("cmd.x", func(o order) (any, error) { return o, nil }),
	})
	if err != nil {
		t.Fatal(err)
	}
	start := func(d *saga.Definition[order], id string) error {
		tx, err := sdb.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		if _, err := saga.StartSQLTx(ctx, tx, d, order{ID: id}, saga.WithID(id), saga.WithWriter(w)); err != nil {
			return err
		}
		return tx.Commit()
	}
	for range 2 {
		if err := start(def, "o-1"); err != nil {
			t.Fatal(err)
		}
	}
	if err := start(other, "o-1"); !errors.Is(err, saga.ErrIDInUse) {
		t.Fatalf("err = %v, want ErrIDInUse", err)
	}
	var sagas, timers, commands int
	if err := db.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+db.Table("saga")+`), (SELECT count(*) FROM `+db.Table("saga_timer")+`),
		(SELECT count(*) FROM `+db.Table("outbox")+` WHERE topic = 'cmd.reserve' AND metadata->>'saga_id' = 'o-1')`).Scan(&sagas, &timers, &commands); err != nil {
		t.Fatal(err)
	}
	if sagas != 1 || timers != 2 || commands != 1 {
		t.Fatalf("sagas %d, timers %d, commands %d; want 1, 2, 1", sagas, timers, commands)
	}
}
