package idempotency_test

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testdb"
)

// Retries waiting for a slow request (WaitInFlight) hold no connection while they wait: with
// a pool of 4, one slow request and three waiting retries of its key, an unrelated owner's
// request is served while the slow one still runs. Waiters beyond MaxWaiters get 409 at once.
// Once the slow request finishes, every waiter replays its response.
func TestWaitingRetriesDoNotPinThePool(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	createOrders(t, db)
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = db.Schema
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	mw, err := idempotency.New(idempotency.Config{Pool: pool, Schema: db.Schema, Owner: ownerFromHeader, WaitInFlight: time.Minute, MaxWaiters: 3})
	if err != nil {
		t.Fatal(err)
	}
	started, release := make(chan struct{}, 1), make(chan struct{})
	var once sync.Once
	releaseOnce := func() { once.Do(func() { close(release) }) }
	t.Cleanup(releaseOnce)
	var runs atomic.Int64
	slow := blockingHandler(started, release)(db, &runs)
	fast := orderHandler(db.Table("orders"), &runs)
	srv := httptest.NewServer(mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-User") == "alice" {
			slow.ServeHTTP(w, r)
			return
		}
		fast.ServeHTTP(w, r)
	})))
	t.Cleanup(srv.Close)
	f := &fixture{db: db, mw: mw, srv: srv}

	results := make(chan response, 4)
	send := func() {
		r, err := f.try("POST", "/orders", "alice", `"slow"`, "book")
		if err != nil {
			t.Error(err)
		}
		results <- r
	}
	go send()
	<-started
	for range 3 {
		go send()
	}
	waitForWaiters(t, mw, 3)

	// Over the bound: 409 at once, while the slow request still runs.
	r := f.send(t, "POST", "/orders", "alice", `"slow"`, "book")
	wantProblem(t, r, http.StatusConflict, idempotency.ProblemInFlight)
	if r.header.Get("Retry-After") == "" {
		t.Fatal("409 without Retry-After")
	}

	// Another owner is served while alice's request still holds its key (and one connection),
	// and three retries wait for it. The bound is generous: it only stops a pinned pool from
	// hanging the test; the slow request is released only after bob's answer.
	start := time.Now()
	bobClient := &http.Client{Transport: srv.Client().Transport, Timeout: 15 * time.Second}
	req, _ := http.NewRequest("POST", srv.URL+"/orders", bytes.NewReader([]byte("pen")))
	req.Header.Set("X-User", "bob")
	req.Header.Set(idempotency.HeaderKey, `"other"`)
	res, err := bobClient.Do(req)
	if err != nil {
		t.Fatalf("bob's request, with alice's slow request and three waiting retries on a pool of 4: %v (after %s)", err, time.Since(start).Round(time.Millisecond))
	}
	res.Body.Close()
	if res.StatusCode != http.StatusCreated {
		t.Fatalf("bob: %d", res.StatusCode)
	}
	t.Logf("bob served in %s while alice's request and 3 waiters were in flight", time.Since(start).Round(time.Millisecond))

	releaseOnce()
	var first response
	replays := 0
	for range 4 {
		r := <-results
		switch {
		case r.status == http.StatusCreated && !r.replayed():
			first = r
		case r.status == http.StatusCreated && r.replayed():
			replays++
		default:
			t.Errorf("alice: %d %s", r.status, r.body)
		}
	}
	if replays != 3 || runs.Load() != 2 {
		t.Fatalf("%d replays of %s, %d runs; want 3 replays and 2 runs (alice once, bob once)", replays, first.body, runs.Load())
	}
	if n := mw.Waiters(); n != 0 {
		t.Fatalf("%d waiters left", n)
	}
}

// waitForWaiters polls until n requests wait for a key held by another request.
func waitForWaiters(t *testing.T, mw *idempotency.Middleware, n int) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for mw.Waiters() < n {
		if time.Now().After(deadline) {
			t.Fatalf("only %d of %d requests wait", mw.Waiters(), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
