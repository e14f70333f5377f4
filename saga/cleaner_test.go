package saga_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/onceflow/onceflow/saga"
)

// The cleaner removes finished sagas older than the window, in batches, and nothing else:
// not recent finished ones, not old sagas still running or stuck.
func TestCleanerRemovesOnlyOldFinishedSagas(t *testing.T) {
	t.Parallel()
	w := newWorld(t, checkoutDef(t, nil))
	ctx := context.Background()
	for _, id := range []string{"old-1", "old-2", "old-3", "recent", "running", "stuck"} {
		w.start(id)
	}
	exec := func(sql string) {
		t.Helper()
		if _, err := w.db.Pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	s := w.db.Schema
	exec(`UPDATE ` + s + `.saga SET state = 'completed', finished_at = now() - interval '100 hours' WHERE id LIKE 'old-%'`)
	exec(`UPDATE ` + s + `.saga SET state = 'compensated', finished_at = now() - interval '1 hour' WHERE id = 'recent'`)
	exec(`UPDATE ` + s + `.saga SET state = 'stuck', created_at = now() - interval '100 days' WHERE id = 'stuck'`)
	exec(`UPDATE ` + s + `.saga SET created_at = now() - interval '100 days' WHERE id = 'running'`)
	c, err := saga.NewCleaner(saga.CleanerConfig{Pool: w.db.Pool, Schema: s, BatchSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	n, err := c.Clean(ctx)
	if err != nil || n != 3 {
		t.Fatalf("Clean = %d, %v; want 3", n, err)
	}
	if left := w.count(`SELECT count(*) FROM ` + s + `.saga`); left != 3 {
		t.Fatalf("%d sagas left, want 3 (recent, running, stuck)", left)
	}
	if _, err := saga.NewCleaner(saga.CleanerConfig{Window: time.Hour, BatchSize: -1}); !errors.As(err, new(*saga.ConfigError)) {
		t.Fatalf("bad config: %v", err)
	}
}
