package outbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
)

type scheduledRow struct {
	EventID  string
	Key      string
	Metadata map[string]string
	DueIn    time.Duration // due_at minus the database's now() when read
}

func readScheduled(t *testing.T, db *testdb.DB) map[string]scheduledRow {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), `SELECT event_id::text, partition_key, metadata,
		extract(epoch FROM due_at - now())::float8 FROM `+db.Table("outbox_scheduled")+` ORDER BY seq`)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]scheduledRow{}
	for rows.Next() {
		var r scheduledRow
		var secs float64
		if err := rows.Scan(&r.EventID, &r.Key, &r.Metadata, &secs); err != nil {
			t.Fatal(err)
		}
		r.DueIn = time.Duration(secs * float64(time.Second))
		out[r.EventID] = r
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestScheduledWriteAndCancel: one write call with immediate and scheduled messages, through
// pgx and through database/sql, puts the immediate ones in the outbox (in call order) and the
// scheduled ones aside with their due times, the scheduling marks consumed; a rolled-back
// call leaves nothing; CancelTx withdraws a scheduled message once and reports false after.
func TestScheduledWriteAndCancel(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, path := range []string{"pgx", "sql"} {
		t.Run(path, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t)
			w := newWriter(t, db, outbox.Config{})
			sdb := sqlDB(t, db)
			run := func(f func(write func(...*message.Message) error, cancel func(string) (bool, error)) error) error {
				if path == "pgx" {
					return pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
						return f(func(m ...*message.Message) error { return w.WriteTx(ctx, tx, "t", m...) },
							func(id string) (bool, error) { return w.CancelTx(ctx, tx, id) })
					})
				}
				tx, err := sdb.BeginTx(ctx, nil)
				if err != nil {
					return err
				}
				err = f(func(m ...*message.Message) error { return w.WriteSQLTx(ctx, tx, "t", m...) },
					func(id string) (bool, error) { return w.CancelSQLTx(ctx, tx, id) })
				if err != nil {
					_ = tx.Rollback()
					return err
				}
				return tx.Commit()
			}
			now1 := outbox.SetPartitionKey(outbox.NewMessage([]byte("1")), "k")
			at := outbox.SetPartitionKey(outbox.DeliverAt(outbox.NewMessage([]byte("at")), time.Now().Add(time.Hour)), "k")
			at.Metadata.Set("note", "kept")
			after := outbox.DeliverAfter(outbox.NewMessage([]byte("after")), 10*time.Minute)
			now2 := outbox.ToTopic(outbox.NewMessage([]byte("2")), "other")
			if err := run(func(write func(...*message.Message) error, _ func(string) (bool, error)) error {
				return write(now1, at, after, now2)
			}); err != nil {
				t.Fatal(err)
			}
			rows := readRows(t, db)
			if len(rows) != 2 || rows[0].EventID != now1.UUID || rows[1].EventID != now2.UUID || rows[1].Topic != "other" {
				t.Fatalf("outbox rows: %+v", rows)
			}
			sched := readScheduled(t, db)
			if len(sched) != 2 {
				t.Fatalf("scheduled rows: %+v", sched)
			}
			if r := sched[at.UUID]; r.Key != "k" || r.DueIn < 59*time.Minute || r.DueIn > time.Hour || len(r.Metadata) != 2 || r.Metadata["note"] != "kept" {
				t.Errorf("DeliverAt row: %+v (want due in about 1h, metadata partition_key and note only)", r)
			}
			if r := sched[after.UUID]; r.DueIn < 9*time.Minute || r.DueIn > 10*time.Minute || len(r.Metadata) != 0 {
				t.Errorf("DeliverAfter row: %+v (want due in about 10m, no metadata)", r)
			}

			// Only scheduled messages, rolled back: nothing stays.
			rolled := outbox.DeliverAfter(outbox.NewMessage([]byte("r")), time.Minute)
			errRollback := errors.New("roll back")
			if err := run(func(write func(...*message.Message) error, _ func(string) (bool, error)) error {
				if err := write(rolled); err != nil {
					return err
				}
				return errRollback
			}); !errors.Is(err, errRollback) {
				t.Fatal(err)
			}
			if _, ok := readScheduled(t, db)[rolled.UUID]; ok {
				t.Fatal("rolled-back scheduled message stayed")
			}

			var first, second bool
			if err := run(func(_ func(...*message.Message) error, cancel func(string) (bool, error)) (err error) {
				if first, err = cancel(at.UUID); err != nil {
					return err
				}
				second, err = cancel(at.UUID)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			if !first || second {
				t.Fatalf("cancel: first %v, second %v; want true, false", first, second)
			}
			if _, ok := readScheduled(t, db)[at.UUID]; ok {
				t.Fatal("cancelled message still scheduled")
			}
			if err := run(func(_ func(...*message.Message) error, cancel func(string) (bool, error)) error {
				ok, err := cancel(now1.UUID) // in the outbox, not scheduled: too late
				if ok {
					t.Error("cancelling an immediate message reported true")
				}
				return err
			}); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestScheduledValidation: a message whose mark cannot be read is refused with the call's
// other messages, and a cancel with an id that is not a UUID says so.
func TestScheduledValidation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	w := newWriter(t, db, outbox.Config{})
	bad := outbox.NewMessage([]byte("x"))
	bad.Metadata.Set(outbox.MetadataDeliverAfter, "tomorrow")
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		return w.WriteTx(ctx, tx, "t", outbox.NewMessage([]byte("ok")), bad)
	})
	var ve *outbox.ValidationError
	if !errors.As(err, &ve) || ve.Index != 1 || !errors.Is(err, outbox.ErrInvalidSchedule) {
		t.Fatalf("err = %v, want a ValidationError for message 1 wrapping ErrInvalidSchedule", err)
	}
	if n := len(readRows(t, db)); n != 0 {
		t.Fatalf("%d rows written by a refused call", n)
	}
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := w.CancelTx(ctx, tx, "not-a-uuid")
		return err
	})
	if !errors.Is(err, outbox.ErrInvalidUUID) {
		t.Fatalf("cancel err = %v, want ErrInvalidUUID", err)
	}
	if at, ok := outbox.ScheduledAt(outbox.DeliverAt(outbox.NewMessage(nil), time.Date(2030, 1, 2, 3, 4, 5, 6000, time.UTC))); !ok || !at.Equal(time.Date(2030, 1, 2, 3, 4, 5, 6000, time.UTC)) {
		t.Fatalf("ScheduledAt = %v, %v", at, ok)
	}
}
