package saga_test

import (
	"context"
	"testing"

	"github.com/onceflow/onceflow/saga"
)

// Where a saga's current command is: still in the outbox (the relay has not published it),
// or published — also when the relay's backlog holds only rows written long after the
// command, which Get tells from the oldest pending row without scanning the outbox.
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
	if got := wait(); got != saga.WaitRelay {
		t.Fatalf("the command is pending in the outbox: wait %q, want %q", got, saga.WaitRelay)
	}
	// Published: the row is gone; a later row, written an hour after it, is pending.
	exec := func(sql string) {
		t.Helper()
		if _, err := w.db.Pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
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
