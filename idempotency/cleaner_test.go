package idempotency_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testdb"
)

func insertRecords(t *testing.T, db *testdb.DB, prefix string, n int, expiresIn string) {
	t.Helper()
	_, err := db.Pool.Exec(context.Background(), `INSERT INTO idempotency_record (owner, idem_key, fingerprint, status, body, expires_at)
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
	n, err := c.RunOnce(context.Background())
	if err != nil || n != 7 {
		t.Fatalf("RunOnce = %d, %v; want 7 deleted", n, err)
	}
	f := &fixture{db: db}
	if left := f.count(t, `SELECT count(*) FROM idempotency_record WHERE idem_key LIKE 'live-%'`); left != 3 || f.records(t) != 3 {
		t.Fatalf("%d live records left of 3, %d in total", left, f.records(t))
	}
	if n, err := c.RunOnce(context.Background()); err != nil || n != 0 {
		t.Fatalf("second RunOnce = %d, %v; want 0", n, err)
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
	srv := httptest.NewServer(mw.Handler(orderHandler(&runs)))
	t.Cleanup(srv.Close)
	f := &fixture{db: db, mw: mw, srv: srv}

	// An expired record for the key, plus other expired ones.
	insertRecords(t, db, "old-", 4, "-1 hour")
	if _, err := db.Pool.Exec(context.Background(), `INSERT INTO idempotency_record (owner, idem_key, fingerprint, status, body, expires_at)
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
	n, err := c.RunOnce(ctx) // would block until ctx ends without SKIP LOCKED
	if err != nil || n != 4 {
		t.Fatalf("RunOnce while a request replaces a record = %d, %v; want the 4 other expired records deleted", n, err)
	}
	close(resume)
	first := <-done
	if first.status != http.StatusCreated || first.replayed() {
		t.Fatalf("request: %d %s", first.status, first.body)
	}
	if n := f.count(t, `SELECT count(*) FROM idempotency_record WHERE owner = 'alice' AND idem_key = 'k' AND expires_at > now()`); n != 1 {
		t.Fatal("the replacing request's record is missing after the cleaner ran")
	}
	if r := f.send(t, "POST", "/orders", "alice", `"k"`, "book"); !r.replayed() || string(r.body) != string(first.body) {
		t.Fatalf("replay: %d %s", r.status, r.body)
	}
	if n, err := c.RunOnce(ctx); err != nil || n != 0 {
		t.Fatalf("RunOnce after = %d, %v; the fresh record must stay", n, err)
	}
	if runs.Load() != 1 {
		t.Fatalf("handler ran %d times", runs.Load())
	}
}

func TestCleanerRunOnSchedule(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	insertRecords(t, db, "old-", 3, "-1 hour")
	c, err := idempotency.NewCleaner(idempotency.CleanerConfig{Pool: db.Pool, Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	errc := make(chan error, 1)
	go func() { errc <- c.Run(ctx, signalSchedule{ran: ran}) }()
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
