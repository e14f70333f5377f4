package idempotency_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/retention"
)

func insertRecords(t *testing.T, db *testdb.DB, prefix string, n int, expiresIn string) {
	t.Helper()
	_, err := db.Pool.Exec(context.Background(), `INSERT INTO `+db.Table("idempotency_record")+` (owner, idem_key, fingerprint, status, body, expires_at)
		SELECT 'alice', $1 || i, '\x00', 201, 'x', now() + $3::interval FROM generate_series(1, $2) AS i`, prefix, n, expiresIn)
	if err != nil {
		t.Fatal(err)
	}
}

func TestCleanerDeletesOnlyExpiredInBatches(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	insertRecords(t, db, "old-", 7, "-1 hour")
	insertRecords(t, db, "live-", 3, "1 hour")
	c, err := idempotency.NewCleaner(idempotency.CleanerConfig{Pool: db.Pool, Schema: db.Schema, BatchSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	n, err := c.Clean(context.Background())
	if err != nil || n != 7 {
		t.Fatalf("Clean = %d, %v; want 7 deleted", n, err)
	}
	f := &fixture{db: db}
	if left := f.count(t, `SELECT count(*) FROM `+f.db.Table("idempotency_record")+` WHERE idem_key LIKE 'live-%'`); left != 3 || f.records(t) != 3 {
		t.Fatalf("%d live records left of 3, %d in total", left, f.records(t))
	}
	if n, err := c.Clean(context.Background()); err != nil || n != 0 {
		t.Fatalf("second Clean = %d, %v; want 0", n, err)
	}
}

// A request replacing an expired record holds that row locked until it commits; the cleaner
// must neither delete it nor wait for it.
func TestCleanerSkipsARecordBeingReplaced(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	createOrders(t, db)
	mw, err := idempotency.New(idempotency.Config{Pool: db.Pool, Schema: db.Schema, Owner: ownerFromHeader})
	if err != nil {
		t.Fatal(err)
	}
	stored, resume := make(chan struct{}), make(chan struct{})
	var hooked atomic.Bool
	mw.SetAfterStore(func() {
		if hooked.CompareAndSwap(false, true) {
			close(stored)
			<-resume
		}
	})
	var runs atomic.Int64
	srv := httptest.NewServer(mw.Handler(orderHandler(db.Table("orders"), &runs)))
	t.Cleanup(srv.Close)
	f := &fixture{db: db, mw: mw, srv: srv}

	// An expired record for the key, plus other expired ones.
	insertRecords(t, db, "old-", 4, "-1 hour")
	if _, err := db.Pool.Exec(context.Background(), `INSERT INTO `+db.Table("idempotency_record")+` (owner, idem_key, fingerprint, status, body, expires_at)
		VALUES ('alice', 'k', '\x00', 201, 'stale', now() - interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	done := make(chan response, 1)
	go func() {
		r, err := f.try("POST", "/orders", "alice", `"k"`, "book")
		if err != nil {
			t.Error(err)
		}
		done <- r
	}()
	<-stored // the request has upserted over the expired row and not committed yet

	c, err := idempotency.NewCleaner(idempotency.CleanerConfig{Pool: db.Pool, Schema: db.Schema, BatchSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	n, err := c.Clean(ctx) // would block until ctx ends without SKIP LOCKED
	if err != nil || n != 4 {
		t.Fatalf("Clean while a request replaces a record = %d, %v; want the 4 other expired records deleted", n, err)
	}
	close(resume)
	first := <-done
	if first.status != http.StatusCreated || first.replayed() {
		t.Fatalf("request: %d %s", first.status, first.body)
	}
	if n := f.count(t, `SELECT count(*) FROM `+f.db.Table("idempotency_record")+` WHERE owner = 'alice' AND idem_key = 'k' AND expires_at > now()`); n != 1 {
		t.Fatal("the replacing request's record is missing after the cleaner ran")
	}
	if r := f.send(t, "POST", "/orders", "alice", `"k"`, "book"); !r.replayed() || string(r.body) != string(first.body) {
		t.Fatalf("replay: %d %s", r.status, r.body)
	}
	if n, err := c.Clean(ctx); err != nil || n != 0 {
		t.Fatalf("Clean after = %d, %v; the fresh record must stay", n, err)
	}
	if runs.Load() != 1 {
		t.Fatalf("handler ran %d times", runs.Load())
	}
}

func TestCleanerRunOnSchedule(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	insertRecords(t, db, "old-", 3, "-1 hour")
	ran := make(chan struct{})
	c, err := idempotency.NewCleaner(idempotency.CleanerConfig{Pool: db.Pool, Schema: db.Schema, Schedule: signalSchedule{ran: ran}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- c.Run(ctx) }()
	f := &fixture{db: db}
	deadline := time.Now().Add(60 * time.Second)
	for f.records(t) != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the scheduled cleaner did not delete the expired records")
		}
		<-ran // the schedule was consulted again: a run has finished
	}
	cancel()
	if err := <-errc; err != context.Canceled {
		t.Fatalf("Run returned %v; want context.Canceled", err)
	}
}

// signalSchedule runs every 10 ms, and tells the test each time it is asked for the next run.
type signalSchedule struct{ ran chan struct{} }

func (s signalSchedule) Next(now time.Time) time.Time {
	select {
	case s.ran <- struct{}{}:
	default:
	}
	return now.Add(10 * time.Millisecond)
}

func TestCleanerConfig(t *testing.T) {
	t.Parallel()
	_, err := idempotency.NewCleaner(idempotency.CleanerConfig{Schema: "x-y", BatchSize: -1, Schedule: retention.Every(-time.Minute)})
	for _, want := range []string{"Pool is nil", "Schema: invalid schema name", "BatchSize is -1", "Schedule: Every(-1m0s): the interval must be positive"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error %v does not report %q", err, want)
		}
	}

	pool, err := pgxpool.New(context.Background(), "postgres://localhost:1/none") // lazy: never connects here
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if _, err := idempotency.NewCleaner(idempotency.CleanerConfig{Pool: pool, Schedule: retention.DailyAt(0, 60)}); err == nil || !strings.Contains(err.Error(), "DailyAt(0, 60)") {
		t.Errorf("DailyAt(0, 60) accepted: %v", err)
	}

	// The zero config cleans daily at 03:00 UTC, 1000 rows a batch, like inbox.Cleaner.
	c, err := idempotency.NewCleaner(idempotency.CleanerConfig{Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	cfg := c.Config()
	if cfg.Schema != "onceflow" || cfg.BatchSize != retention.DefaultBatchSize || cfg.Logger == nil || cfg.Schedule != retention.DefaultSchedule {
		t.Fatalf("defaults %+v", cfg)
	}
	evening := time.Date(2026, 12, 31, 23, 0, 0, 0, time.UTC)
	if next := cfg.Schedule.Next(evening); !next.Equal(evening.Add(4 * time.Hour)) {
		t.Fatalf("default schedule runs next at %s, want 03:00 UTC", next)
	}
	c, err = idempotency.NewCleaner(idempotency.CleanerConfig{Pool: pool, Schedule: retention.DailyAt(0, 0)})
	if err != nil {
		t.Fatal(err)
	}
	if next := c.Config().Schedule.Next(evening); !next.Equal(evening.Add(time.Hour)) {
		t.Fatalf("DailyAt(0, 0) runs next at %s, want midnight", next)
	}
}

// ExampleCleaner is the snippet of docs/http-idempotency.md ("Using it"): expired records
// deleted hourly from the service process.
func ExampleCleaner() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	cleaner, err := idempotency.NewCleaner(idempotency.CleanerConfig{
		Pool:     pool,
		Schedule: retention.Every(time.Hour), // default daily at 03:00 UTC
	})
	if err != nil {
		panic(err)
	}
	go cleaner.Run(ctx) // until ctx ends; or cleaner.Clean(ctx) for one pass
}
