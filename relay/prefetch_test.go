package relay_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// orderSink acknowledges everything and records the event ids in the order it was given them.
// Before its call number hookAt (1-based) it runs hook.
type orderSink struct {
	mu     sync.Mutex
	ids    []string
	calls  int
	hookAt int
	hook   func()
}

func (s *orderSink) Publish(_ context.Context, msgs []*relay.Message, _ []error) {
	s.mu.Lock()
	s.calls++
	call := s.calls
	s.mu.Unlock()
	if call == s.hookAt {
		s.hook()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range msgs {
		s.ids = append(s.ids, m.EventID)
	}
}

func (*orderSink) Close() error { return nil }

func (s *orderSink) published() (all, distinct int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	seen := map[string]bool{}
	for _, id := range s.ids {
		seen[id] = true
	}
	return len(s.ids), len(seen)
}

// TestPrefetchDroppedAfterLateCommit: while a batch is published, the relay already claims the
// next one. A transaction that took the lowest id and commits during that publish is a late
// commit for that prefetched claim, which therefore starts below the cursor, where the batch
// being published is not deleted yet. Those rows must not go out a second time: the relay
// drops such a prefetch and claims again after deleting them. Every event is published
// exactly once here (no fault anywhere), the late one included.
func TestPrefetchDroppedAfterLateCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	// Deletes take 200 ms: the prefetch sends the delete of an earlier batch first, so its
	// snapshot is taken well after the publish it overlaps has begun.
	s := pgsql.Ident(db.Schema)
	for _, stmt := range []string{
		`CREATE FUNCTION ` + s + `.slow_deletes() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_sleep(0.2); RETURN NULL; END $$`,
		`CREATE TRIGGER slow_deletes BEFORE DELETE ON ` + s + `.outbox FOR EACH STATEMENT EXECUTE FUNCTION ` + s + `.slow_deletes()`,
	} {
		if _, err := db.Pool.Exec(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	write := func(tx pgx.Tx, key string, n int) {
		for i := range n {
			m := outbox.SetPartitionKey(outbox.NewMessage(fmt.Appendf(nil, "%s/%d", key, i)), key)
			if err := w.WriteTx(ctx, tx, "prefetch", m); err != nil {
				t.Fatal(err)
			}
		}
	}
	// The late row: the lowest id, committed by the sink during its third call.
	late, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = late.Rollback(ctx) })
	write(late, "late", 1)
	const rows = 100
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		for k := range 4 {
			write(tx, fmt.Sprintf("key-%d", k), rows/4)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	sink := &orderSink{hookAt: 3, hook: func() {
		if err := late.Commit(ctx); err != nil {
			t.Error(err)
		}
	}}
	r, err := relay.New(relay.Config{Pool: db.Pool, Sink: sink, Schema: db.Schema, BatchSize: 10, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	stop := startRelay(t, r)
	eventually(t, 30*time.Second, "every event published", func() bool {
		_, distinct := sink.published()
		return distinct == rows+1
	})
	eventually(t, 30*time.Second, "empty outbox", func() bool { return outboxCount(t, db) == 0 })
	stop()
	if all, distinct := sink.published(); all != distinct {
		t.Fatalf("%d events published %d times: a prefetched claim below the cursor published rows of the batch before it again", distinct, all)
	}
}
