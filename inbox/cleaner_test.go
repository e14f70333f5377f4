package inbox_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/retention"
)

// batchRecorder is a pgx tracer that records how many rows each DELETE removed, so the test
// sees the cleaner's batches on a real pool.
type batchRecorder struct {
	mu      sync.Mutex
	batches []int64
}

func (b *batchRecorder) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (b *batchRecorder) TraceQueryEnd(_ context.Context, _ *pgx.Conn, data pgx.TraceQueryEndData) {
	if data.Err == nil && data.CommandTag.Delete() {
		b.mu.Lock()
		b.batches = append(b.batches, data.CommandTag.RowsAffected())
		b.mu.Unlock()
	}
}

// tracedPool opens a second pool on db's server whose statements rec observes.
func tracedPool(t *testing.T, db *testdb.DB, rec *batchRecorder) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Tracer = rec
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// lazyPool never connects: for tests of config validation and defaults.
func lazyPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), "postgres://localhost:1/none")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func insertDedupRows(t *testing.T, db *testdb.DB, consumer string, n int, age time.Duration) {
	t.Helper()
	_, err := db.Pool.Exec(context.Background(), `INSERT INTO `+db.Table("processed_event")+` (consumer, dedup_key, processed_at)
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
	if err := holder.QueryRow(ctx, `SELECT dedup_key FROM `+db.Table("processed_event")+` WHERE consumer = 'b' AND processed_at < now() - interval '72 hours' LIMIT 1 FOR UPDATE`).Scan(&lockedKey); err != nil {
		t.Fatal(err)
	}

	rec := &batchRecorder{}
	c, err := inbox.NewCleaner(inbox.CleanerConfig{Pool: tracedPool(t, db, rec), Schema: db.Schema, BatchSize: 7})
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
	if got := f.count(`SELECT count(*) FROM ` + f.db.Table("processed_event") + ` WHERE processed_at < now() - interval '72 hours'`); got != 1 {
		t.Fatalf("%d expired rows left, want only the locked one", got)
	}
	if got := f.count(`SELECT count(*) FROM ` + f.db.Table("processed_event") + ` WHERE processed_at >= now() - interval '72 hours'`); got != 20 {
		t.Fatalf("%d young rows left, want 20", got)
	}
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := c.Clean(ctx); err != nil || n != 1 {
		t.Fatalf("second run deleted %d (%v), want the formerly locked row", n, err)
	}
	if got := f.count(`SELECT count(*) FROM `+f.db.Table("processed_event")+` WHERE dedup_key = $1`, lockedKey); got != 0 {
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
	c, err := inbox.NewCleaner(inbox.CleanerConfig{Pool: f.db.Pool, Schema: f.db.Schema, Window: 48 * time.Hour, Consumer: "b"})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := c.Clean(ctx); err != nil || n != 4 {
		t.Fatalf("deleted %d (%v), want b's 4 rows", n, err)
	}
	if f.count(`SELECT count(*) FROM `+f.db.Table("processed_event")+` WHERE consumer = 'a'`) != 3 {
		t.Fatal("another consumer's rows were deleted")
	}

	// Run cleans on its schedule until the context ends. A short window needs the override.
	_, err = inbox.NewCleaner(inbox.CleanerConfig{Pool: f.db.Pool, Schema: f.db.Schema, Window: time.Hour})
	if err == nil || !strings.Contains(err.Error(), "under the 24h0m0s minimum") || !strings.Contains(err.Error(), "set AllowShortWindow") {
		t.Fatalf("1h window without override: %v", err)
	}
	insertDedupRows(t, f.db, "a", 2, 2*time.Hour)
	c, err = inbox.NewCleaner(inbox.CleanerConfig{
		Pool: f.db.Pool, Schema: f.db.Schema, Window: time.Hour, AllowShortWindow: true, Schedule: retention.Every(20 * time.Millisecond),
	})
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
	_, err := inbox.NewCleaner(inbox.CleanerConfig{Schema: "No", Window: 23 * time.Hour, BatchSize: -1, Schedule: retention.DailyAt(24, 0), Consumer: "\x00"})
	for _, want := range []string{"Pool is nil", "invalid schema name", "Window is 23h0m0s, under the 24h0m0s minimum", "BatchSize is -1",
		"Schedule: DailyAt(24, 0): want hour 0-23 and minute 0-59 (UTC); midnight is DailyAt(0, 0)", "NUL"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error %v does not report %q", err, want)
		}
	}
	if _, err := inbox.NewCleaner(inbox.CleanerConfig{Pool: lazyPool(t), Schedule: retention.Every(0)}); err == nil || !strings.Contains(err.Error(), "Every(0s): the interval must be positive") {
		t.Errorf("Every(0) accepted: %v", err)
	}

	// The zero config cleans daily at 03:00 UTC, 72h, 1000 rows a batch.
	c, err := inbox.NewCleaner(inbox.CleanerConfig{Pool: lazyPool(t)})
	if err != nil {
		t.Fatal(err)
	}
	cfg := c.Config()
	if cfg.Window != inbox.DefaultWindow || cfg.BatchSize != retention.DefaultBatchSize || cfg.Schema != "onceflow" || cfg.Logger == nil {
		t.Fatalf("defaults %+v", cfg)
	}
	noon := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	if cfg.Schedule != retention.DefaultSchedule || !cfg.Schedule.Next(noon).Equal(noon.Add(15*time.Hour)) {
		t.Fatalf("default schedule %v runs next at %s, want daily 03:00 UTC", cfg.Schedule, cfg.Schedule.Next(noon))
	}

	// Midnight is DailyAt(0, 0): no zero-value trap.
	c, err = inbox.NewCleaner(inbox.CleanerConfig{Pool: lazyPool(t), Schedule: retention.DailyAt(0, 0)})
	if err != nil {
		t.Fatal(err)
	}
	if next := c.Config().Schedule.Next(noon); !next.Equal(noon.Add(12 * time.Hour)) {
		t.Fatalf("DailyAt(0, 0) runs next at %s, want midnight", next)
	}
}

// ExampleCleaner keeps processed_event bounded from a long-running consumer process.
func ExampleCleaner() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	cleaner, err := inbox.NewCleaner(inbox.CleanerConfig{
		Pool:     pool,
		Window:   7 * 24 * time.Hour,      // default 72h; keep it above the redelivery horizon
		Schedule: retention.DailyAt(0, 0), // default daily at 03:00 UTC
	})
	if err != nil {
		panic(err)
	}
	go cleaner.Run(ctx) // until ctx ends; or cleaner.Clean(ctx) for one pass, e.g. from a cron job
}

// Barrier rows (saga_id set) outlive the window while their saga lives. With
// CleanerConfig.Sagas the cleaner asks which sagas live, a batch at a time: rows of live
// sagas stay however many share one timestamp (the batches still move on), rows of other
// sagas and ordinary rows go, and a failing Sagas deletes no barrier row of its batch.
func TestCleanerKeepsBarrierRowsOfLiveSagas(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	insertDedupRows(t, db, "svc-charge", 5, 100*time.Hour)
	// 7 sagas with two barrier rows each, all written at the same instant, 100 hours ago.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("processed_event")+` (consumer, dedup_key, saga_id, processed_at)
		SELECT 'svc-charge', 'saga-barrier:' || s || ':' || ph, 's' || s, now() - interval '100 hours'
		FROM generate_series(1, 7) s, unnest(ARRAY['action', 'compensation']) ph`); err != nil {
		t.Fatal(err)
	}
	live := map[string]bool{"s2": true, "s5": true, "s7": true}
	var asked []int
	var failing bool
	c, err := inbox.NewCleaner(inbox.CleanerConfig{Pool: db.Pool, Schema: db.Schema, BatchSize: 3,
		Sagas: func(_ context.Context, ids []string) ([]string, error) {
			if failing {
				return nil, errors.New("orchestrator database unreachable")
			}
			asked = append(asked, len(ids))
			var alive []string
			for _, id := range ids {
				if live[id] {
					alive = append(alive, id)
				}
			}
			return alive, nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	left := func() []string {
		rows, err := db.Pool.Query(ctx, `SELECT coalesce(saga_id, '-') FROM `+db.Table("processed_event")+` ORDER BY 1`)
		if err != nil {
			t.Fatal(err)
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return ids
	}
	failing = true
	if _, err := c.Clean(ctx); err == nil || !strings.Contains(err.Error(), "orchestrator database unreachable") {
		t.Fatalf("Clean with a failing Sagas: %v, want its error", err)
	}
	if got := left(); len(got) != 14 {
		t.Fatalf("after a failing Sagas: rows left %v, want the 14 barrier rows (the ordinary rows go first)", got)
	}
	failing = false
	n, err := c.Clean(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := strings.Join(left(), " "), "s2 s2 s5 s5 s7 s7"; n != 8 || got != want {
		t.Fatalf("deleted %d, rows left %q; want 8 deleted and %q", n, got, want)
	}
	for _, k := range asked {
		if k > 3 {
			t.Fatalf("Sagas asked about %d ids at once, more than BatchSize: %v", k, asked)
		}
	}
}
