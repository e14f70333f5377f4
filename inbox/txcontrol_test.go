package inbox_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/outbox"
)

var endingStatements = testutil.EndingStatements

// allowedStatements must keep working: savepoints, and text that only mentions the keywords.
var allowedStatements = []string{
	"SAVEPOINT s1",
	"RELEASE SAVEPOINT s1",
	"SAVEPOINT s2; ROLLBACK TO SAVEPOINT s2",
	"savepoint s3; rollback to s3",
	"SAVEPOINT s4; ROLLBACK WORK TO SAVEPOINT s4; RELEASE s4",
	"SELECT 'COMMIT; ROLLBACK'",
	"SELECT $$;commit$$, $tag$ ; end $tag$",
	`SELECT 1 AS "commit;"; SELECT 2`,
	"-- COMMIT\nSELECT 1",
	"/* ; ROLLBACK */ SELECT 1",
	"SELECT E'\\';commit'",
	"PREPARE onceflow_stmt AS SELECT 1",
	"DEALLOCATE onceflow_stmt",
	"SET LOCAL lock_timeout = '5s'",
	"SELECT 1 AS commit_count",
}

var sendVia = testutil.SendVia

// A handler that ends its transaction with SQL, and even ignores the error it gets: the
// message fails, nothing of the attempt is kept (no effect, no dedup row, no event), and the
// redelivery runs the handler once.
func TestHandlerCannotEndTheTransactionWithSQL(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	for _, c := range endingStatements {
		msg := outbox.NewMessage([]byte(c.Name))
		attempts := 0
		h := f.ib.Middleware(func(m *message.Message) ([]*message.Message, error) {
			attempts++
			ctx := m.Context()
			if err := f.applyEffect(m, "before"); err != nil {
				return nil, err
			}
			if attempts == 1 {
				err := sendVia(ctx, outbox.MustTx(ctx), c.Via, c.SQL)
				if c.Via == "exec" && !errors.Is(err, outbox.ErrTxManaged) {
					t.Errorf("%s: Exec = %v; want ErrTxManaged", c.Name, err)
				}
				// ... and carries on as if nothing happened.
			}
			if err := f.applyEffect(m, "after"); err != nil {
				return nil, err
			}
			return []*message.Message{outbox.ToTopic(outbox.NewMessage([]byte(m.UUID)), "events")}, nil
		})
		_, err := h(msg.Copy())
		kept := fmt.Sprintf("effects %d, dedup rows %d, events %d", f.effects(msg.UUID), f.dedupOf(msg), f.eventsOf(msg))
		if !errors.Is(err, outbox.ErrTxManaged) || kept != "effects 0, dedup rows 0, events 0" {
			t.Errorf("%s: first delivery returned %v and kept %s; want ErrTxManaged and nothing kept", c.Name, err, kept)
			continue
		}
		if _, err := h(msg.Copy()); err != nil {
			t.Errorf("%s: redelivery: %v", c.Name, err)
		}
		if _, err := h(msg.Copy()); err != nil { // a duplicate now
			t.Errorf("%s: third delivery: %v", c.Name, err)
		}
		if kept := fmt.Sprintf("effects %d, dedup rows %d, events %d", f.effects(msg.UUID), f.dedupOf(msg), f.eventsOf(msg)); kept != "effects 2, dedup rows 1, events 1" || attempts != 2 {
			t.Errorf("%s: after the redeliveries: %s in %d runs; want effects 2, dedup rows 1, events 1 in 2 runs", c.Name, kept, attempts)
		}
	}
}

// Savepoints and statements that merely mention the keywords pass through.
func TestHandlerSavepointsAndLookalikesAllowed(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	msg := outbox.NewMessage([]byte("x"))
	h := f.ib.Middleware(func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		for _, sql := range allowedStatements {
			if _, err := outbox.MustTx(ctx).Exec(ctx, sql); err != nil {
				return nil, fmt.Errorf("%q: %w", sql, err)
			}
		}
		return nil, f.applyEffect(m, "")
	})
	if _, err := h(msg); err != nil {
		t.Fatal(err)
	}
	if f.effects(msg.UUID) != 1 || f.dedupOf(msg) != 1 {
		t.Fatalf("effects %d dedup rows %d; want 1 and 1", f.effects(msg.UUID), f.dedupOf(msg))
	}
}

// Going around the view (tx.Conn()) cannot be refused before it runs; the middleware sees
// the ended transaction afterwards and fails the message without writing anything more. A
// ROLLBACK that way loses the attempt, as a failure should; a COMMIT that way has already
// committed the effect with its dedup row — which the error says — so the redelivery is a
// duplicate and the handler's events are not written.
func TestHandlerEndingTheTransactionAroundTheView(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	for _, c := range []struct {
		sql, keptAfterFailure, keptAtEnd string
		runs                             int
	}{
		{"ROLLBACK", "effects 0, dedup rows 0, events 0", "effects 2, dedup rows 1, events 1", 2},
		{"COMMIT", "effects 1, dedup rows 1, events 0", "effects 1, dedup rows 1, events 0", 1},
	} {
		msg := outbox.NewMessage([]byte(c.sql))
		runs := 0
		h := f.ib.Middleware(func(m *message.Message) ([]*message.Message, error) {
			runs++
			ctx := m.Context()
			if err := f.applyEffect(m, ""); err != nil {
				return nil, err
			}
			if runs == 1 {
				if err := sendVia(ctx, outbox.MustTx(ctx), "conn", c.sql); err != nil {
					return nil, err
				}
			} else if err := f.applyEffect(m, "again"); err != nil {
				return nil, err
			}
			return []*message.Message{outbox.ToTopic(outbox.NewMessage([]byte(m.UUID)), "events")}, nil
		})
		_, err := h(msg.Copy())
		kept := fmt.Sprintf("effects %d, dedup rows %d, events %d", f.effects(msg.UUID), f.dedupOf(msg), f.eventsOf(msg))
		if !errors.Is(err, outbox.ErrTxManaged) || kept != c.keptAfterFailure {
			t.Errorf("%s on the connection: %v, kept %s; want ErrTxManaged and %s", c.sql, err, kept, c.keptAfterFailure)
			continue
		}
		if _, err := h(msg.Copy()); err != nil {
			t.Errorf("%s: redelivery: %v", c.sql, err)
		}
		if kept := fmt.Sprintf("effects %d, dedup rows %d, events %d", f.effects(msg.UUID), f.dedupOf(msg), f.eventsOf(msg)); kept != c.keptAtEnd || runs != c.runs {
			t.Errorf("%s: after the redelivery: %s in %d runs; want %s in %d", c.sql, kept, runs, c.keptAtEnd, c.runs)
		}
	}
}

// A statement failed and the handler carried on and returned success: the transaction is
// aborted, so the message fails with an error saying so, and the redelivery runs again.
func TestHandlerIgnoringAFailedStatement(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	msg := outbox.NewMessage([]byte("x"))
	runs := 0
	h := f.ib.Middleware(func(m *message.Message) ([]*message.Message, error) {
		runs++
		ctx := m.Context()
		if err := f.applyEffect(m, ""); err != nil {
			return nil, err
		}
		if runs == 1 {
			_, _ = outbox.MustTx(ctx).Exec(ctx, "SELECT 1/0") // ignored
		}
		return nil, nil
	})
	if _, err := h(msg.Copy()); err == nil || !strings.Contains(err.Error(), "transaction is aborted") {
		t.Fatalf("first delivery: %v; want an error saying the transaction is aborted", err)
	}
	if _, err := h(msg.Copy()); err != nil {
		t.Fatal(err)
	}
	if f.effects(msg.UUID) != 1 || f.dedupOf(msg) != 1 || runs != 2 {
		t.Fatalf("effects %d dedup rows %d runs %d; want 1, 1, 2", f.effects(msg.UUID), f.dedupOf(msg), runs)
	}
}

func (f *fixture) dedupOf(msg *message.Message) int {
	return f.count(`SELECT count(*) FROM `+f.db.Table("processed_event")+` WHERE dedup_key = $1`, "event:"+msg.UUID)
}

func (f *fixture) eventsOf(msg *message.Message) int {
	return f.count(`SELECT count(*) FROM `+f.db.Table("outbox")+` WHERE payload = $1`, []byte(msg.UUID))
}
