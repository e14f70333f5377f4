package audit_test

import (
	"context"
	"errors"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/audit"
	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/saga"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// Every operator action writes one record, in its own transaction: committed, the record is
// there with who, what, on which ids, the filter and the outcome; rolled back, there is none.
func TestEveryActionIsRecordedInItsTransaction(t *testing.T) {
	t.Parallel()
	ctx := audit.WithActor(context.Background(), "alice")
	db := testdb.New(t)
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := db.Pool.Exec(context.Background(), sql, args...); err != nil {
			t.Fatal(err)
		}
	}
	steps := `[{"name": "reserve", "status": "running", "attempts": 1}, {"name": "charge", "status": "pending"}]`
	exec(`INSERT INTO `+db.Table("saga")+` (id, name, version, state, step, attempt, waiting, data, steps) VALUES
		('s-stuck', 'checkout', 1, 'stuck', 0, 1, '', '{}', $1), ('s-running', 'checkout', 1, 'running', 0, 1, 'reply', '{}', $1),
		('s-resend', 'checkout', 1, 'running', 0, 1, 'resend', '{}', $1)`, steps)
	exec(`INSERT INTO ` + db.Table("saga_timer") + ` (saga_id, kind, step, phase, attempt, action, due_at) VALUES ('s-resend', 'step', 0, 'action', 1, 'resend', now() + interval '1 minute')`)
	exec(`INSERT INTO ` + db.Table("outbox_parked") + ` (id, event_id, topic, partition_key, key_hash, payload, metadata, created_at, attempts, last_error, parked_by)
		VALUES (7, '0190b5a0-0000-7000-8000-000000000007', 'payments', 'p-1', 3, '{}', '{}', now(), 10, 'too large', 'relay-a')`)
	var poison [2]int64
	for i := range poison {
		if err := db.Pool.QueryRow(context.Background(), `INSERT INTO `+db.Table("inbox_poison")+` (consumer, dedup_key, message_uuid, payload, attempts, error)
			VALUES ('billing', $1, $1, '{}', 5, $2) RETURNING id`, "k-"+strconv.Itoa(i), []string{"timeout", "bad"}[i]).Scan(&poison[i]); err != nil {
			t.Fatal(err)
		}
	}
	sagas, err := saga.NewAdmin(db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	relays, err := relay.NewAdmin(db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	inboxes, err := inbox.NewAdmin(db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	p0, p1 := strconv.FormatInt(poison[0], 10), strconv.FormatInt(poison[1], 10)
	for _, c := range []struct {
		action, target, outcome string
		run                     func(tx pgx.Tx) error
	}{
		{audit.SagaRetry, "s-stuck", "requested", func(tx pgx.Tx) error { return sagas.RetryTx(ctx, tx, "s-stuck") }},
		{audit.SagaCompensate, "s-running", "requested", func(tx pgx.Tx) error { return sagas.CompensateTx(ctx, tx, "s-running") }},
		{audit.SagaUpgrade, "s-resend", "requested from version 1 to version 2", func(tx pgx.Tx) error { return sagas.RequestUpgradeTx(ctx, tx, "s-resend", 1, 2) }},
		{audit.OutboxReplay, "0190b5a0-0000-7000-8000-000000000007", "rows moved back to the outbox: 1", func(tx pgx.Tx) error {
			_, err := relays.ReplayTx(ctx, tx, relay.ParkedFilter{Topic: "payments"})
			return err
		}},
		{audit.InboxReplay, p0, "replays requested: 1", func(tx pgx.Tx) error {
			_, err := inboxes.ReplayTx(ctx, tx, inbox.ReplayFilter{IDs: []int64{poison[0]}})
			return err
		}},
		{audit.InboxDelete, p1, "poison rows deleted: 1", func(tx pgx.Tx) error {
			_, err := inboxes.DeletePoisonTx(ctx, tx, inbox.DeleteFilter{Consumer: "billing", ErrorContains: "BAD"})
			return err
		}},
	} {
		// Rolled back: no record (and no action).
		errRollback := errors.New("rollback")
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			if err := c.run(tx); err != nil {
				return err
			}
			return errRollback
		}); !errors.Is(err, errRollback) {
			t.Fatalf("%s: %v", c.action, err)
		}
		if es, err := audit.List(ctx, db.Pool, db.Schema, audit.Filter{Target: c.target}); err != nil || len(es) != 0 {
			t.Fatalf("%s rolled back, yet recorded: %+v (%v)", c.action, es, err)
		}
		if err := pgx.BeginFunc(ctx, db.Pool, c.run); err != nil {
			t.Fatalf("%s: %v", c.action, err)
		}
		es, err := audit.List(ctx, db.Pool, db.Schema, audit.Filter{Target: c.target, Actions: []string{c.action}})
		if err != nil || len(es) != 1 {
			t.Fatalf("%s: %d records (%v), want 1", c.action, len(es), err)
		}
		if e := es[0]; e.Actor != "alice" || e.Outcome != c.outcome || e.At.IsZero() {
			t.Errorf("%s recorded as %+v", c.action, e)
		}
	}
	// The filter a bulk action selected by, and "service" when no actor is given.
	es, err := audit.List(ctx, db.Pool, db.Schema, audit.Filter{Target: p1})
	if err != nil || len(es) != 1 || es[0].Filter != `consumer "billing", error containing "BAD"` {
		t.Errorf("the delete's filter: %+v (%v)", es, err)
	}
	if got := audit.ActorFrom(context.Background()); got != "service" {
		t.Errorf("ActorFrom without an actor: %q", got)
	}
	all, err := audit.List(ctx, db.Pool, db.Schema, audit.Filter{Limit: 4})
	if err != nil || len(all) != 4 || all[0].Action != audit.InboxDelete || all[0].ID <= all[1].ID {
		t.Errorf("the newest 4 records: %+v (%v)", all, err)
	}
	if next, err := audit.List(ctx, db.Pool, db.Schema, audit.Filter{Before: all[3].ID}); err != nil || len(next) != 2 {
		t.Errorf("the page before record %d: %d records (%v), want 2", all[3].ID, len(next), err)
	}
}
