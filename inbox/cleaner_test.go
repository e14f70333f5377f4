package inbox_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/testdb"
)

// batchRecorder passes statements to the real pool and records how many rows each deleted.
type batchRecorder struct {
	db      inbox.Execer
	mu      sync.Mutex
	batches []int64
}

func (b *batchRecorder) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	tag, err := b.db.Exec(ctx, sql, args...)
	b.mu.Lock()
	b.batches = append(b.batches, tag.RowsAffected())
	b.mu.Unlock()
	return tag, err
}

func insertDedupRows(t *testing.T, db *testdb.DB, consumer string, n int, age time.Duration) {
	t.Helper()
	_, err := db.Pool.Exec(context.Background(), `INSERT INTO processed_event (consumer, dedup_key, processed_at)
		SELECT $1, $4 || '-' || g, now() - make_interval(secs => $3) FROM generate_series(1, $2) g`,
		consumer, n, age.Seconds(), consumer+"-"+age.String())
	if err != nil {
		t.Fatal(err)
	}
}

// The cleaner removes only rows older than the window, in batches of at most BatchSize, and
// skips (rather than waits on) a row an in-flight transaction holds.
func TestCleanerDeletesOnlyExpiredRowsInBatches(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, nil)
	db := f.db
	insertDedupRows(t, db, "a", 30, 100*time.Hour)
	insertDedupRows(t, db, "b", 5, 73*time.Hour)
	insertDedupRows(t, db, "a", 10, 71*time.Hour)
	insertDedupRows(t, db, "b", 10, 0)

	// An in-flight transaction holds one expired row.
	holder, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	var lockedKey string
	if err := holder.QueryRow(ctx, `SELECT dedup_key FROM processed_event WHERE consumer = 'b' AND processed_at < now() - interval '72 hours' LIMIT 1 FOR UPDATE`).Scan(&lockedKey); err != nil {
		t.Fatal(err)
	}

	rec := &batchRecorder{db: db.Pool}
	c, err := inbox.NewCleaner(inbox.CleanerConfig{DB: rec, Schema: db.Schema, BatchSize: 7})
	if err != nil {
		t.Fatal(err)
	}
	if c.Config().Window != 72*time.Hour {
		t.Fatalf("default window %s", c.Config().Window)
	}
	cctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	n, err := c.Clean(cctx)
	if err != nil {
		t.Fatal(err)
	}
	if n != 34 {
		t.Fatalf("deleted %d rows, want the 34 expired and unlocked ones", n)
	}
	var sum int64
	for _, b := range rec.batches {
		if b > 7 {
			t.Fatalf("a batch deleted %d rows, over BatchSize 7 (batches %v)", b, rec.batches)
		}
		sum += b
	}
	if sum != 34 || len(rec.batches) < 5 {
		t.Fatalf("batches %v", rec.batches)
	}
	if got := f.count(`SELECT count(*) FROM processed_event WHERE processed_at < now() - interval '72 hours'`); got != 1 {
		t.Fatalf("%d expired rows left, want only the locked one", got)
	}
	if got := f.count(`SELECT count(*) FROM processed_event WHERE processed_at >= now() - interval '72 hours'`); got != 20 {
		t.Fatalf("%d young rows left, want 20", got)
	}
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := c.Clean(ctx); err != nil || n != 1 {
		t.Fatalf("second run deleted %d (%v), want the formerly locked row", n, err)
	}
	if got := f.count(`SELECT count(*) FROM processed_event WHERE dedup_key = $1`, lockedKey); got != 0 {
		t.Fatal("locked row survived the second run")
	}
}

func TestCleanerPerConsumerAndSchedule(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, nil)
	insertDedupRows(t, f.db, "a", 3, 50*time.Hour)
	insertDedupRows(t, f.db, "b", 4, 50*time.Hour)

	// A 48h window for consumer b only: a's rows stay.
	c, err := inbox.NewCleaner(inbox.CleanerConfig{DB: f.db.Pool, Schema: f.db.Schema, Window: 48 * time.Hour, Consumer: "b"})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := c.Clean(ctx); err != nil || n != 4 {
		t.Fatalf("deleted %d (%v), want b's 4 rows", n, err)
	}
	if f.count(`SELECT count(*) FROM processed_event WHERE consumer = 'a'`) != 3 {
		t.Fatal("another consumer's rows were deleted")
	}

	// Run cleans on its schedule until the context ends. A short window needs the override.
	_, err = inbox.NewCleaner(inbox.CleanerConfig{DB: f.db.Pool, Schema: f.db.Schema, Window: time.Hour})
	if err == nil || !strings.Contains(err.Error(), "under the 24h0m0s minimum") {
		t.Fatalf("1h window without override: %v", err)
	}
	insertDedupRows(t, f.db, "a", 2, 2*time.Hour)
	c, err = inbox.NewCleaner(inbox.CleanerConfig{DB: f.db.Pool, Schema: f.db.Schema, Window: time.Hour, AllowShortWindow: true, Interval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(rctx) }()
	waitFor(t, "the scheduled run", func() bool { return f.dedupRows() == 0 })
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Run returned %v", err)
	}
}

func TestCleanerConfigValidation(t *testing.T) {
	t.Parallel()
	_, err := inbox.NewCleaner(inbox.CleanerConfig{Schema: "No", Window: 23 * time.Hour, BatchSize: -1, Interval: -time.Second, DailyAt: 25 * time.Hour, Consumer: "\x00"})
	for _, want := range []string{"DB is nil", "invalid schema name", "Window is 23h0m0s, under the 24h0m0s minimum", "BatchSize is -1", "Interval is -1s", "DailyAt is 25h0m0s", "NUL"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error %v does not report %q", err, want)
		}
	}
	c, err := inbox.NewCleaner(inbox.CleanerConfig{DB: &batchRecorder{}})
	if err != nil {
		t.Fatal(err)
	}
	if cfg := c.Config(); cfg.Window != inbox.DefaultRetention || cfg.BatchSize != 1000 || cfg.DailyAt != 3*time.Hour || cfg.Schema != "onceflow" {
		t.Fatalf("defaults %+v", cfg)
	}
}
