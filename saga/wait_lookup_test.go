package saga_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/saga"
)

// backlogRows is the relay backlog the bounded-lookup tests put in front of a command: enough
// that the planner reads the outbox by index only when the statement lets it, and a scan shows.
const backlogRows = 100_000

// lookup is one Admin.Get of saga id in a transaction of its own, with what it cost the
// outbox and outbox_parked: the sequential scans of each that the backend counted during the
// Get (pg_stat_xact_user_tables, read before and after it in the transaction: the backend
// reports its counts only between transactions, and they may include earlier ones' until
// then). Parallel workers are off so that a scan is counted in this backend.
type lookup struct {
	wait                     *saga.Wait
	outboxScans, parkedScans int64
}

func getCounted(t *testing.T, w *world, id string) lookup {
	t.Helper()
	ctx := context.Background()
	var l lookup
	err := pgx.BeginFunc(ctx, w.db.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL max_parallel_workers_per_gather = 0`); err != nil {
			return err
		}
		scans := func() (outbox, parked int64, err error) {
			err = tx.QueryRow(ctx, `SELECT
				coalesce((SELECT seq_scan FROM pg_stat_xact_user_tables WHERE relid = $1::regclass), 0),
				coalesce((SELECT seq_scan FROM pg_stat_xact_user_tables WHERE relid = $2::regclass), 0)`,
				w.db.Table("outbox"), w.db.Table("outbox_parked")).Scan(&outbox, &parked)
			return outbox, parked, err
		}
		o0, p0, err := scans()
		if err != nil {
			return err
		}
		d, err := w.admin().Get(ctx, tx, id)
		if err != nil {
			return err
		}
		l.wait = d.Wait
		o1, p1, err := scans()
		l.outboxScans, l.parkedScans = o1-o0, p1-p0
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if l.wait == nil {
		t.Fatal("the saga waits for nothing")
	}
	return l
}

// A saga's command waiting behind a large relay backlog older than the command (a stalled
// relay: exactly when an operator looks) is found by index probes, with no scan of the outbox,
// through every place the command can be: pending, parked, replayed (back in the outbox under
// a new id), published. The command is the second step's, written by the orchestrator's
// transition that applied the first step's reply, per message and in a batch.
func TestWaitFindsTheCommandBehindAnOlderBacklogWithoutAScan(t *testing.T) {
	forModes(t, func(t *testing.T, batched bool) {
		ctx := context.Background()
		w := newWorldMode(t, batched, checkoutDef(t, nil), "charge")
		id := w.start("o-1")
		if err := w.bus.RunUntil(ctx, func() bool { d := w.get(id); return d.Wait != nil && d.Wait.Step == "charge" }); err != nil {
			t.Fatal(err)
		}
		exec := func(sql string, args ...any) {
			t.Helper()
			if _, err := w.db.Pool.Exec(ctx, sql, args...); err != nil {
				t.Fatal(err)
			}
		}
		// The backlog: rows of 10,000 transactions, all written an hour before the command, so
		// the oldest pending row does not tell that the command was published.
		exec(`INSERT INTO `+w.db.Table("outbox")+` (event_id, topic, partition_key, key_hash, payload, created_at, tx)
			SELECT gen_random_uuid(), 'other', 'k-' || (g % 1000), g % 1000, '{}', now() - interval '1 hour', (1000000000 + g / 10)::text::xid8
			FROM generate_series(1, $1::int) g`, backlogRows)
		exec(`ANALYZE ` + w.db.Table("outbox"))

		l := getCounted(t, w, id)
		if l.wait.For != saga.WaitRelay || l.wait.Step != "charge" || l.outboxScans != 0 {
			t.Fatalf("pending behind %d older rows: wait %q at step %q with %d scans of the outbox, want %q at charge with none",
				backlogRows, l.wait.For, l.wait.Step, l.outboxScans, saga.WaitRelay)
		}
		cmd := l.wait.EventID

		// The relay parks it (as relay's park statement does: the row keeps its outbox id).
		exec(`WITH moved AS (DELETE FROM `+w.db.Table("outbox")+` WHERE event_id = $1::uuid RETURNING *)
			INSERT INTO `+w.db.Table("outbox_parked")+` (id, event_id, topic, partition_key, key_hash, payload, metadata, created_at, attempts, last_error)
			SELECT id, event_id, topic, partition_key, key_hash, payload, metadata, created_at, 5, 'UNKNOWN_TOPIC_OR_PARTITION' FROM moved`, cmd)
		if l = getCounted(t, w, id); l.wait.For != saga.WaitParked || l.wait.PublishAttempts != 5 || l.wait.PublishError != "UNKNOWN_TOPIC_OR_PARTITION" ||
			l.outboxScans != 0 || l.parkedScans != 0 {
			t.Fatalf("parked: wait %+v with %d+%d scans, want %q with its attempts and error and none", l.wait, l.outboxScans, l.parkedScans, saga.WaitParked)
		}

		// An operator replays it: back in the outbox under a new id, written by the replay's
		// transaction.
		relayAdmin, err := relay.NewAdmin(w.db.Schema)
		if err != nil {
			t.Fatal(err)
		}
		if err := pgx.BeginFunc(ctx, w.db.Pool, func(tx pgx.Tx) error {
			_, err := relayAdmin.ReplayTx(ctx, tx, relay.ParkedFilter{EventIDs: []string{cmd}})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if l = getCounted(t, w, id); l.wait.For != saga.WaitRelay || l.wait.PublishAttempts != 0 || l.outboxScans != 0 {
			t.Fatalf("replayed: wait %+v with %d scans, want %q with a fresh attempt count and none", l.wait, l.outboxScans, saga.WaitRelay)
		}

		// Published: the relay deleted it; the backlog stays.
		exec(`DELETE FROM `+w.db.Table("outbox")+` WHERE event_id = $1::uuid`, cmd)
		if l = getCounted(t, w, id); l.wait.For != saga.WaitReply || l.outboxScans != 0 || l.parkedScans != 0 {
			t.Fatalf("published: wait %q with %d+%d scans, want %q and none", l.wait.For, l.outboxScans, l.parkedScans, saga.WaitReply)
		}
	})
}

// A saga row that does not record where its command was written — written before migration
// 0019, or by an older release during a rolling deploy, which leaves the record of an earlier
// command — is looked up by event id as before: it still gets the right answer, and that lookup
// is a scan of the outbox behind an older backlog (which is what shows the bounded lookup's
// count above means something).
func TestWaitWithoutARecordOfTheCommandFallsBackToTheEventID(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newWorld(t, checkoutDef(t, nil), "reserve")
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := w.db.Pool.Exec(ctx, sql, args...); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct{ name, forget string }{
		{"no record", `UPDATE ` + w.db.Table("saga") + ` SET command_event = NULL, command_tx = NULL WHERE id = $1`},
		{"an earlier command's", `UPDATE ` + w.db.Table("saga") + ` SET command_event = gen_random_uuid() WHERE id = $1`},
	} {
		id := w.start("o-" + c.name)
		exec(c.forget, id)
		if l := getCounted(t, w, id); l.wait.For != saga.WaitRelay {
			t.Fatalf("%s: pending: wait %q, want %q", c.name, l.wait.For, saga.WaitRelay)
		}
	}
	exec(`INSERT INTO `+w.db.Table("outbox")+` (event_id, topic, partition_key, key_hash, payload, created_at)
		SELECT gen_random_uuid(), 'other', 'k', 1, '{}', now() - interval '1 hour' FROM generate_series(1, $1::int)`, backlogRows)
	exec(`ANALYZE ` + w.db.Table("outbox"))
	if l := getCounted(t, w, "o-no record"); l.wait.For != saga.WaitRelay || l.outboxScans != 1 {
		t.Fatalf("pending behind an older backlog, without a record: wait %q with %d scans, want %q with the one scan", l.wait.For, l.outboxScans, saga.WaitRelay)
	}
	// A saga started now, behind the same backlog, with its record (written by StartTx): no scan.
	if l := getCounted(t, w, w.start("o-recorded")); l.wait.For != saga.WaitRelay || l.outboxScans != 0 {
		t.Fatalf("started behind the backlog, with its record: wait %q with %d scans, want %q with none", l.wait.For, l.outboxScans, saga.WaitRelay)
	}
}

// Without a record of the command, where the saga's current command is: still in the outbox
// (the relay has not published it), or published — also when the relay's backlog holds only
// rows written long after the command, which Get tells from the oldest pending row without
// scanning the outbox.
func TestWaitFindsTheCommandInTheOutbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newWorld(t, checkoutDef(t, nil), "reserve")
	id := w.start("o-1")
	admin, err := saga.NewAdmin(w.db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	wait := func() string {
		t.Helper()
		d, err := admin.Get(ctx, w.db.Pool, id)
		if err != nil || d.Wait == nil {
			t.Fatalf("get: %v", err)
		}
		return d.Wait.For
	}
	exec := func(sql string) {
		t.Helper()
		if _, err := w.db.Pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	exec(`UPDATE ` + w.db.Table("saga") + ` SET command_event = NULL, command_tx = NULL`) // as written before migration 0019
	if got := wait(); got != saga.WaitRelay {
		t.Fatalf("the command is pending in the outbox: wait %q, want %q", got, saga.WaitRelay)
	}
	// Published: the row is gone; a later row, written an hour after it, is pending.
	exec(`DELETE FROM ` + w.db.Table("outbox"))
	exec(`INSERT INTO ` + w.db.Table("outbox") + ` (event_id, topic, partition_key, key_hash, payload, created_at)
		VALUES (gen_random_uuid(), 'other', 'k', 1, '{}', now() + interval '1 hour')`)
	if got := wait(); got != saga.WaitReply {
		t.Fatalf("the command was published: wait %q, want %q", got, saga.WaitReply)
	}
	// A backlog that started before the command: looked up, and not found.
	exec(`UPDATE ` + w.db.Table("outbox") + ` SET created_at = now() - interval '1 hour'`)
	if got := wait(); got != saga.WaitReply {
		t.Fatalf("the command was published, behind an older backlog: wait %q, want %q", got, saga.WaitReply)
	}
}
