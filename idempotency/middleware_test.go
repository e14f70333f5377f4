package idempotency_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
)

func TestMain(m *testing.M) {
	if mode := os.Getenv(childEnv); mode != "" {
		runChild(mode) // crash tests re-run this binary as a server that gets SIGKILLed
		return
	}
	testdb.Main(m)
}

// ownerFromHeader stands in for authentication that ran before the middleware.
func ownerFromHeader(r *http.Request) (string, error) {
	if u := r.Header.Get("X-User"); u != "" {
		return u, nil
	}
	return "", idempotency.ErrNoOwner
}

// createOrders creates the business table the handlers write to.
func createOrders(t *testing.T, db *testdb.DB) {
	t.Helper()
	if _, err := db.Pool.Exec(context.Background(), `CREATE TABLE `+db.Table("orders")+` (id bigserial PRIMARY KEY, owner text NOT NULL, item text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
}

// orderHandler inserts one order into orders (the schema-qualified table) in the middleware's
// transaction and answers 201 with a body that differs on every execution, plus headers that
// must and must not be replayed.
func orderHandler(orders string, runs *atomic.Int64) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		ctx := r.Context()
		body, _ := io.ReadAll(r.Body)
		var id int64
		if err := outbox.MustTx(ctx).QueryRow(ctx, `INSERT INTO `+orders+` (owner, item) VALUES ($1, $2) RETURNING id`, r.Header.Get("X-User"), string(body)).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
		w.Header().Set("ETag", fmt.Sprintf(`"v%d"`, id))
		w.Header().Set("Set-Cookie", "session=secret")
		w.Header().Set("X-Handler", "ran")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d,"owner":%q,"item":%q,"at":%q}`, id, r.Header.Get("X-User"), body, time.Now().Format(time.RFC3339Nano))
	}
}

type fixture struct {
	db   *testdb.DB
	mw   *idempotency.Middleware
	srv  *httptest.Server
	runs atomic.Int64
}

// newFixture serves handler (orderHandler when nil) behind the middleware on a real loopback
// HTTP server, on a fresh migrated schema with an orders table.
func newFixture(t *testing.T, cfg idempotency.Config, handler func(*testdb.DB, *atomic.Int64) http.Handler) *fixture {
	t.Helper()
	f := &fixture{db: testdb.New(t)}
	createOrders(t, f.db)
	cfg.Pool, cfg.Schema = f.db.Pool, f.db.Schema
	if cfg.Owner == nil {
		cfg.Owner = ownerFromHeader
	}
	mw, err := idempotency.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	f.mw = mw
	h := http.Handler(orderHandler(f.db.Table("orders"), &f.runs))
	if handler != nil {
		h = handler(f.db, &f.runs)
	}
	f.srv = httptest.NewServer(mw.Handler(h))
	t.Cleanup(f.srv.Close)
	return f
}

type response struct {
	status int
	header http.Header
	body   []byte
}

func (r response) replayed() bool { return r.header.Get(idempotency.HeaderReplayed) == "true" }

func (r response) problemType() string {
	var p struct {
		Type string `json:"type"`
	}
	json.Unmarshal(r.body, &p)
	return strings.TrimPrefix(p.Type, idempotency.DefaultProblemBase)
}

// send makes one request; key "" sends no Idempotency-Key, keys are sent verbatim.
func (f *fixture) send(t *testing.T, method, path, user, key, body string, extra ...string) response {
	t.Helper()
	r, err := f.try(method, path, user, key, body, extra...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func (f *fixture) try(method, path, user, key, body string, extra ...string) (response, error) {
	req, err := http.NewRequest(method, f.srv.URL+path, strings.NewReader(body))
	if err != nil {
		return response{}, err
	}
	if user != "" {
		req.Header.Set("X-User", user)
	}
	if key != "" {
		req.Header.Set(idempotency.HeaderKey, key)
	}
	for i := 0; i+1 < len(extra); i += 2 {
		req.Header.Add(extra[i], extra[i+1])
	}
	// A bounded wait: a request that should have been refused but runs a blocked handler
	// fails the test instead of hanging it.
	client := &http.Client{Transport: f.srv.Client().Transport, Timeout: time.Minute}
	res, err := client.Do(req)
	if err != nil {
		return response{}, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	return response{status: res.StatusCode, header: res.Header, body: b}, err
}

func (f *fixture) count(t *testing.T, query string, args ...any) int {
	t.Helper()
	var n int
	if err := f.db.Pool.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func (f *fixture) orders(t *testing.T) int {
	return f.count(t, `SELECT count(*) FROM `+f.db.Table("orders"))
}
func (f *fixture) records(t *testing.T) int {
	return f.count(t, `SELECT count(*) FROM `+f.db.Table("idempotency_record"))
}

func wantProblem(t *testing.T, r response, status int, typ string) {
	t.Helper()
	if r.status != status || r.header.Get("Content-Type") != "application/problem+json" || r.problemType() != typ {
		t.Fatalf("got %d %s %s; want %d problem+json of type %s", r.status, r.header.Get("Content-Type"), r.body, status, typ)
	}
}

func TestReplayIsByteForByteAndHandlerRunsOnce(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idempotency.Config{}, nil)
	key := `"8e03978e-40d5-43e8-bc93-6894a57f9324"`
	first := f.send(t, "POST", "/orders", "alice", key, "book")
	if first.status != http.StatusCreated || first.replayed() || first.header.Get("Set-Cookie") == "" {
		t.Fatalf("first response: %d %v %s", first.status, first.header, first.body)
	}
	for i := 0; i < 3; i++ {
		again := f.send(t, "POST", "/orders", "alice", key, "book")
		if again.status != http.StatusCreated || !bytes.Equal(again.body, first.body) {
			t.Fatalf("retry %d: %d %s; want 201 %s", i, again.status, again.body, first.body)
		}
		if !again.replayed() {
			t.Fatalf("retry %d lacks %s: true", i, idempotency.HeaderReplayed)
		}
		for _, h := range []string{"Content-Type", "Location", "ETag"} {
			if again.header.Get(h) != first.header.Get(h) {
				t.Fatalf("retry %d: %s = %q; first had %q", i, h, again.header.Get(h), first.header.Get(h))
			}
		}
		for _, h := range []string{"Set-Cookie", "X-Handler"} {
			if v := again.header.Get(h); v != "" {
				t.Fatalf("retry %d replayed %s: %q", i, h, v)
			}
		}
	}
	if n := f.runs.Load(); n != 1 {
		t.Fatalf("handler ran %d times; want 1", n)
	}
	if n := f.orders(t); n != 1 {
		t.Fatalf("%d orders; want 1", n)
	}
	// The record expires one retention after it was written, on the database clock.
	if n := f.count(t, `SELECT count(*) FROM `+f.db.Table("idempotency_record")+` WHERE owner = 'alice' AND idem_key = $1 AND expires_at - created_at = interval '24 hours' AND created_at <= now()`, "8e03978e-40d5-43e8-bc93-6894a57f9324"); n != 1 {
		t.Fatalf("record with a 24h expiry: %d; want 1", n)
	}
	// The same key unquoted is the same key.
	bare := f.send(t, "POST", "/orders", "alice", "8e03978e-40d5-43e8-bc93-6894a57f9324", "book")
	if !bare.replayed() || !bytes.Equal(bare.body, first.body) {
		t.Fatalf("bare-token retry: %d %s", bare.status, bare.body)
	}
}

func TestKeyReusedWithDifferentRequest(t *testing.T) {
	t.Parallel()
	for _, status := range []int{0, http.StatusConflict} {
		t.Run(fmt.Sprint(status), func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, idempotency.Config{MismatchStatus: status, Methods: []string{"POST", "PATCH"}}, nil)
			want := http.StatusUnprocessableEntity
			if status != 0 {
				want = status
			}
			first := f.send(t, "POST", "/orders?x=1", "alice", `"k1"`, "book")
			if first.status != http.StatusCreated {
				t.Fatalf("first: %d %s", first.status, first.body)
			}
			for _, c := range []struct{ name, method, path, body string }{
				{"body", "POST", "/orders?x=1", "pen"},
				{"path", "POST", "/orders/2?x=1", "book"},
				{"query", "POST", "/orders?x=2", "book"},
				{"method", "PATCH", "/orders?x=1", "book"},
			} {
				r := f.send(t, c.method, c.path, "alice", `"k1"`, c.body)
				wantProblem(t, r, want, idempotency.ProblemKeyReused)
			}
			if n := f.runs.Load(); n != 1 {
				t.Fatalf("handler ran %d times; want 1", n)
			}
			// The original request still replays.
			if r := f.send(t, "POST", "/orders?x=1", "alice", `"k1"`, "book"); !r.replayed() || !bytes.Equal(r.body, first.body) {
				t.Fatalf("replay after mismatches: %d %s", r.status, r.body)
			}
		})
	}
}

// blockingHandler inserts an order, reports that it started, and waits for release.
func blockingHandler(started chan<- struct{}, release <-chan struct{}) func(*testdb.DB, *atomic.Int64) http.Handler {
	return func(db *testdb.DB, runs *atomic.Int64) http.Handler {
		inner := orderHandler(db.Table("orders"), runs)
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			select {
			case started <- struct{}{}:
			default:
			}
			select {
			case <-release:
			case <-r.Context().Done():
				http.Error(w, "cancelled", http.StatusServiceUnavailable)
				return
			}
			inner(w, r)
		})
	}
}

func TestInFlightGets409WithRetryAfter(t *testing.T) {
	t.Parallel()
	started, release := make(chan struct{}, 1), make(chan struct{})
	f := newFixture(t, idempotency.Config{RetryAfter: 1500 * time.Millisecond}, blockingHandler(started, release))
	var once sync.Once
	releaseOnce := func() { once.Do(func() { close(release) }) }
	t.Cleanup(releaseOnce)

	firstDone := make(chan response, 1)
	go func() {
		r, err := f.try("POST", "/orders", "alice", `"k"`, "book")
		if err != nil {
			t.Error(err)
		}
		firstDone <- r
	}()
	<-started
	r := f.send(t, "POST", "/orders", "alice", `"k"`, "book")
	wantProblem(t, r, http.StatusConflict, idempotency.ProblemInFlight)
	if ra := r.header.Get("Retry-After"); ra != "2" {
		t.Fatalf("Retry-After = %q; want 2 (1.5 s rounded up)", ra)
	}
	// Another owner with the same key is not held up by alice's request: bob's enters the
	// handler while alice's is still in it.
	bobDone := make(chan response, 1)
	go func() {
		r, err := f.try("POST", "/orders", "bob", `"k"`, "pen")
		if err != nil {
			t.Error(err)
		}
		bobDone <- r
	}()
	<-started
	releaseOnce()
	first, bob := <-firstDone, <-bobDone
	if bob.status != http.StatusCreated || bob.replayed() {
		t.Fatalf("bob: %d %s", bob.status, bob.body)
	}
	if first.status != http.StatusCreated {
		t.Fatalf("first: %d %s", first.status, first.body)
	}
	again := f.send(t, "POST", "/orders", "alice", `"k"`, "book")
	if !again.replayed() || !bytes.Equal(again.body, first.body) {
		t.Fatalf("retry after completion: %d %s", again.status, again.body)
	}
	if n := f.count(t, `SELECT count(*) FROM `+f.db.Table("orders")+` WHERE owner = 'alice'`); n != 1 {
		t.Fatalf("alice has %d orders; want 1", n)
	}
}

func TestWaitInFlightThenReplay(t *testing.T) {
	t.Parallel()
	started, release := make(chan struct{}, 1), make(chan struct{})
	f := newFixture(t, idempotency.Config{WaitInFlight: time.Minute}, blockingHandler(started, release))
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(release) }) })

	results := make(chan response, 2)
	go func() {
		r, err := f.try("POST", "/orders", "alice", `"k"`, "book")
		if err != nil {
			t.Error(err)
		}
		results <- r
	}()
	<-started
	go func() {
		r, err := f.try("POST", "/orders", "alice", `"k"`, "book")
		if err != nil {
			t.Error(err)
		}
		results <- r
	}()
	waitForWaiters(t, f.mw, 1)
	once.Do(func() { close(release) })
	a, b := <-results, <-results
	if a.replayed() == b.replayed() || a.status != http.StatusCreated || b.status != http.StatusCreated || !bytes.Equal(a.body, b.body) {
		t.Fatalf("want the original and one replay of it; got %d %v %s and %d %v %s", a.status, a.replayed(), a.body, b.status, b.replayed(), b.body)
	}
	if n := f.runs.Load(); n != 1 {
		t.Fatalf("handler ran %d times; want 1", n)
	}
}

func TestWaitInFlightBoundThen409(t *testing.T) {
	t.Parallel()
	started, release := make(chan struct{}, 1), make(chan struct{})
	f := newFixture(t, idempotency.Config{WaitInFlight: 300 * time.Millisecond}, blockingHandler(started, release))
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(release) }) })
	go f.try("POST", "/orders", "alice", `"k"`, "book")
	<-started
	// The first request stays blocked until released, so the waiter must give up.
	r := f.send(t, "POST", "/orders", "alice", `"k"`, "book")
	wantProblem(t, r, http.StatusConflict, idempotency.ProblemInFlight)
	if r.header.Get("Retry-After") == "" {
		t.Fatal("409 without Retry-After")
	}
}

func TestSameKeyTwoOwnersAreIndependent(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idempotency.Config{}, nil)
	a := f.send(t, "POST", "/orders", "alice", `"shared"`, "book")
	b := f.send(t, "POST", "/orders", "bob", `"shared"`, "book") // same request, other owner
	if a.status != http.StatusCreated || b.status != http.StatusCreated || a.replayed() || b.replayed() || bytes.Equal(a.body, b.body) {
		t.Fatalf("two owners: %d %s / %d %s; want two independent executions", a.status, a.body, b.status, b.body)
	}
	ra := f.send(t, "POST", "/orders", "alice", `"shared"`, "book")
	rb := f.send(t, "POST", "/orders", "bob", `"shared"`, "book")
	if !bytes.Equal(ra.body, a.body) || !bytes.Equal(rb.body, b.body) || !strings.Contains(string(rb.body), `"owner":"bob"`) {
		t.Fatalf("replays crossed owners: alice got %s, bob got %s", ra.body, rb.body)
	}
	if n := f.runs.Load(); n != 2 {
		t.Fatalf("handler ran %d times; want 2", n)
	}
}

func TestConcurrentIdenticalRequestsRunOnce(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name  string
		wait  time.Duration
		block bool // hold the first request in its handler while the crowd arrives
	}{
		{"refused while running", 0, true},
		{"free race", 0, false},
		{"wait then replay", time.Minute, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			const n = 50
			wait := c.wait
			started, release := make(chan struct{}, 1), make(chan struct{})
			f := newFixture(t, idempotency.Config{WaitInFlight: wait}, blockingHandler(started, release))
			var once sync.Once
			t.Cleanup(func() { once.Do(func() { close(release) }) })
			if !c.block {
				once.Do(func() { close(release) })
			}
			results := make(chan response, n)
			var wg sync.WaitGroup
			for i := 0; i < n; i++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					r, err := f.try("POST", "/orders", "alice", `"same"`, "book")
					if err != nil {
						t.Error(err)
					}
					results <- r
				}()
			}
			<-started
			if !c.block {
				// Nothing to orchestrate: the crowd races the first request's commit.
			} else if wait == 0 {
				// Let part of the crowd be refused while the first is running; the rest race
				// with its commit and get a 409 or a replay.
				deadline := time.Now().Add(60 * time.Second)
				for len(results) < n/2 {
					if time.Now().After(deadline) {
						t.Fatalf("only %d of %d requests were answered while the first was running; the others are stuck, in the handler?", len(results), n)
					}
					time.Sleep(5 * time.Millisecond)
				}
			} else {
				waitForWaiters(t, f.mw, 1)
			}
			once.Do(func() { close(release) })
			wg.Wait()
			close(results)
			var original []byte
			originals, replays, conflicts := 0, 0, 0
			var all []response
			for r := range results {
				all = append(all, r)
				switch {
				case r.status == http.StatusCreated && !r.replayed():
					originals++
					original = r.body
				case r.status == http.StatusCreated:
					replays++
				case r.status == http.StatusConflict && r.problemType() == idempotency.ProblemInFlight:
					conflicts++
				default:
					t.Fatalf("unexpected response %d %s", r.status, r.body)
				}
			}
			for _, r := range all {
				if r.status == http.StatusCreated && !bytes.Equal(r.body, original) {
					t.Fatalf("a replay differs from the original: %s vs %s", r.body, original)
				}
			}
			if originals != 1 || f.runs.Load() != 1 || f.orders(t) != 1 {
				t.Fatalf("%d originals, %d handler runs, %d orders; want 1 each", originals, f.runs.Load(), f.orders(t))
			}
			if wait > 0 && replays != n-1 {
				t.Fatalf("with WaitInFlight: %d replays, %d conflicts; want %d replays", replays, conflicts, n-1)
			}
			t.Logf("1 original, %d replays, %d conflicts", replays, conflicts)
		})
	}
}

func TestServerErrorRollsBackAndRetryRuns(t *testing.T) {
	t.Parallel()
	var fail atomic.Bool
	fail.Store(true)
	f := newFixture(t, idempotency.Config{}, func(db *testdb.DB, runs *atomic.Int64) http.Handler {
		inner := orderHandler(db.Table("orders"), runs)
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if fail.Load() {
				runs.Add(1)
				tx := outbox.MustTx(r.Context())
				if _, err := tx.Exec(r.Context(), `INSERT INTO `+db.Table("orders")+` (owner, item) VALUES ('alice', 'doomed')`); err != nil {
					t.Error(err)
				}
				http.Error(w, "downstream failed", http.StatusBadGateway)
				return
			}
			inner(w, r)
		})
	})
	r := f.send(t, "POST", "/orders", "alice", `"k"`, "book")
	if r.status != http.StatusBadGateway || r.replayed() {
		t.Fatalf("failing handler: %d %s", r.status, r.body)
	}
	if f.orders(t) != 0 || f.records(t) != 0 {
		t.Fatalf("after a 502: %d orders, %d records; want none", f.orders(t), f.records(t))
	}
	fail.Store(false)
	ok := f.send(t, "POST", "/orders", "alice", `"k"`, "book")
	if ok.status != http.StatusCreated || ok.replayed() || f.runs.Load() != 2 || f.orders(t) != 1 {
		t.Fatalf("retry: %d replayed=%v runs=%d orders=%d", ok.status, ok.replayed(), f.runs.Load(), f.orders(t))
	}
}

func TestPanicRollsBackAndPropagates(t *testing.T) {
	t.Parallel()
	var panicking atomic.Bool
	panicking.Store(true)
	handler := func(db *testdb.DB, runs *atomic.Int64) http.Handler {
		inner := orderHandler(db.Table("orders"), runs)
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if panicking.Load() {
				tx := outbox.MustTx(r.Context())
				if _, err := tx.Exec(r.Context(), `INSERT INTO `+db.Table("orders")+` (owner, item) VALUES ('alice', 'doomed')`); err != nil {
					t.Error(err)
				}
				w.WriteHeader(http.StatusCreated)
				w.Write([]byte("partial"))
				w.(http.Flusher).Flush() // must not leak the 201 to the client
				panic("boom")
			}
			inner(w, r)
		})
	}
	f := newFixture(t, idempotency.Config{}, handler)

	// Directly: the panic reaches the caller after the rollback, and nothing was written.
	rec := httptest.NewRecorder()
	req := httptest.NewRequest("POST", "/orders", strings.NewReader("book"))
	req.Header.Set("X-User", "alice")
	req.Header.Set(idempotency.HeaderKey, `"k"`)
	func() {
		defer func() {
			if v := recover(); v != "boom" {
				t.Fatalf("recovered %v; want the handler's panic", v)
			}
		}()
		f.mw.Handler(handler(f.db, &f.runs)).ServeHTTP(rec, req)
	}()
	if rec.Flushed || rec.Body.Len() != 0 || len(rec.Header()) != 0 {
		t.Fatalf("the panicking handler's response leaked: flushed=%v header=%v body=%q", rec.Flushed, rec.Header(), rec.Body)
	}
	// Through a real server: net/http recovers and drops the connection.
	if r, err := f.try("POST", "/orders", "alice", `"k"`, "book"); err == nil {
		t.Fatalf("client got a response from a panicking handler: %d %s", r.status, r.body)
	}
	if f.orders(t) != 0 || f.records(t) != 0 {
		t.Fatalf("after panics: %d orders, %d records; want none", f.orders(t), f.records(t))
	}
	panicking.Store(false)
	ok := f.send(t, "POST", "/orders", "alice", `"k"`, "book")
	if ok.status != http.StatusCreated || ok.replayed() || f.orders(t) != 1 {
		t.Fatalf("retry after panic: %d replayed=%v orders=%d", ok.status, ok.replayed(), f.orders(t))
	}
}

// dropAfterCommit is a server-side writer that kills the connection on the first attempt to
// send the response, which the middleware makes only after its commit.
type dropAfterCommit struct {
	http.ResponseWriter
	dropped *atomic.Bool
}

func (d dropAfterCommit) WriteHeader(int) {
	if conn, _, err := http.NewResponseController(d.ResponseWriter).Hijack(); err == nil {
		d.dropped.Store(true) // before Close: the client may look as soon as the connection drops
		conn.Close()
	}
}
func (d dropAfterCommit) Write(p []byte) (int, error) { return 0, errors.New("connection dropped") }

func TestResponseLostAfterCommitIsReplayed(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	createOrders(t, db)
	mw, err := idempotency.New(idempotency.Config{Pool: db.Pool, Schema: db.Schema, Owner: ownerFromHeader})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	var dropNext, dropped atomic.Bool
	dropNext.Store(true)
	app := mw.Handler(orderHandler(db.Table("orders"), &runs))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if dropNext.CompareAndSwap(true, false) {
			w = dropAfterCommit{ResponseWriter: w, dropped: &dropped}
		}
		app.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	f := &fixture{db: db, mw: mw, srv: srv}

	if r, err := f.try("POST", "/orders", "alice", `"k"`, "book"); err == nil {
		t.Fatalf("the first response reached the client: %d %s", r.status, r.body)
	}
	if !dropped.Load() {
		t.Fatal("the connection was not dropped")
	}
	r := f.send(t, "POST", "/orders", "alice", `"k"`, "book")
	if r.status != http.StatusCreated || !r.replayed() || runs.Load() != 1 || f.orders(t) != 1 {
		t.Fatalf("retry: %d replayed=%v runs=%d orders=%d %s", r.status, r.replayed(), runs.Load(), f.orders(t), r.body)
	}
	var id int64
	if err := db.Pool.QueryRow(context.Background(), `SELECT id FROM `+db.Table("orders")).Scan(&id); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(r.body), fmt.Sprintf(`"id":%d`, id)) {
		t.Fatalf("replayed body %s does not describe order %d", r.body, id)
	}
}

func TestExpiredRecordRunsAsNew(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idempotency.Config{}, nil)
	first := f.send(t, "POST", "/orders", "alice", `"k"`, "book")
	// Expire it on the database clock; the cleaner has not run, the row is still there.
	if _, err := f.db.Pool.Exec(context.Background(), `UPDATE `+f.db.Table("idempotency_record")+` SET expires_at = now() - interval '1 second'`); err != nil {
		t.Fatal(err)
	}
	// Even a different request with the same key runs: an expired record counts as absent.
	second := f.send(t, "POST", "/orders", "alice", `"k"`, "pen")
	if second.status != http.StatusCreated || second.replayed() || bytes.Equal(first.body, second.body) {
		t.Fatalf("after expiry: %d replayed=%v %s", second.status, second.replayed(), second.body)
	}
	if f.runs.Load() != 2 || f.orders(t) != 2 || f.records(t) != 1 {
		t.Fatalf("runs=%d orders=%d records=%d; want 2, 2, 1", f.runs.Load(), f.orders(t), f.records(t))
	}
	// The new record replaced the old one and replays the new response.
	if r := f.send(t, "POST", "/orders", "alice", `"k"`, "pen"); !r.replayed() || !bytes.Equal(r.body, second.body) {
		t.Fatalf("replay of the new record: %d %s", r.status, r.body)
	}
	if n := f.count(t, `SELECT count(*) FROM `+f.db.Table("idempotency_record")+` WHERE expires_at > now() + interval '23 hours'`); n != 1 {
		t.Fatalf("the replacement record does not have a fresh expiry")
	}
}

func TestLargeResponseSentOnceNotReplayed(t *testing.T) {
	t.Parallel()
	big := strings.Repeat("x", 4096)
	f := newFixture(t, idempotency.Config{MaxStoredResponseBytes: 1024}, func(db *testdb.DB, runs *atomic.Int64) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			if _, err := outbox.MustTx(r.Context()).Exec(r.Context(), `INSERT INTO `+db.Table("orders")+` (owner, item) VALUES ('alice', 'big')`); err != nil {
				t.Error(err)
			}
			w.Header().Set("Content-Type", "text/plain")
			w.Header().Set("Location", "/reports/1")
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, big)
		})
	})
	first := f.send(t, "POST", "/reports", "alice", `"k"`, "")
	if first.status != http.StatusCreated || string(first.body) != big {
		t.Fatalf("first caller: %d, %d bytes; want 201 and the full %d bytes", first.status, len(first.body), len(big))
	}
	again := f.send(t, "POST", "/reports", "alice", `"k"`, "")
	wantProblem(t, again, http.StatusGone, idempotency.ProblemResponseNotStored)
	var p struct {
		OriginalStatus int `json:"original_status"`
	}
	json.Unmarshal(again.body, &p)
	if p.OriginalStatus != http.StatusCreated || again.header.Get("Location") != "/reports/1" || !again.replayed() {
		t.Fatalf("not-stored answer: original_status=%d Location=%q replayed=%v", p.OriginalStatus, again.header.Get("Location"), again.replayed())
	}
	if f.runs.Load() != 1 || f.orders(t) != 1 {
		t.Fatalf("runs=%d orders=%d; want 1, 1", f.runs.Load(), f.orders(t))
	}
	if n := f.count(t, `SELECT count(*) FROM `+f.db.Table("idempotency_record")+` WHERE body IS NULL AND status = 201`); n != 1 {
		t.Fatal("the record should keep the status and no body")
	}
}

func TestBodyTooLargeIsRefusedBeforeAnything(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idempotency.Config{MaxBodyBytes: 10}, nil)
	r := f.send(t, "POST", "/orders", "alice", `"k"`, strings.Repeat("y", 11))
	wantProblem(t, r, http.StatusRequestEntityTooLarge, idempotency.ProblemBodyTooLarge)
	// Without Content-Length (chunked), the limit still holds.
	req, _ := http.NewRequest("POST", f.srv.URL+"/orders", io.MultiReader(strings.NewReader(strings.Repeat("y", 11))))
	req.Header.Set("X-User", "alice")
	req.Header.Set(idempotency.HeaderKey, `"k2"`)
	res, err := f.srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusRequestEntityTooLarge {
		t.Fatalf("chunked oversize body: %d", res.StatusCode)
	}
	if f.runs.Load() != 0 || f.records(t) != 0 || f.orders(t) != 0 {
		t.Fatal("an oversize request ran or stored something")
	}
	if ok := f.send(t, "POST", "/orders", "alice", `"k"`, "ten bytes!"); ok.status != http.StatusCreated {
		t.Fatalf("a body at the limit: %d %s", ok.status, ok.body)
	}
}

func TestMalformedKeysAre400AndStoreNothing(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idempotency.Config{}, nil)
	for _, c := range []struct {
		name  string
		key   string
		extra []string
	}{
		{"empty string", `""`, nil},
		{"list", `"a", "b"`, nil},
		{"unterminated", `"abc`, nil},
		{"too long", `"` + strings.Repeat("k", 256) + `"`, nil},
		{"byte sequence", `:aGk=:`, nil},
		{"repeated header lines", `"a"`, []string{idempotency.HeaderKey, `"a"`}},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := f.send(t, "POST", "/orders", "alice", c.key, "book", c.extra...)
			wantProblem(t, r, http.StatusBadRequest, idempotency.ProblemKeyInvalid)
		})
	}
	if f.runs.Load() != 0 || f.records(t) != 0 || f.orders(t) != 0 {
		t.Fatal("a malformed key ran or stored something")
	}
}

func TestMissingKeyRequiredOrOptional(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	createOrders(t, db)
	mw, err := idempotency.New(idempotency.Config{Pool: db.Pool, Schema: db.Schema, Owner: ownerFromHeader})
	if err != nil {
		t.Fatal(err)
	}
	var sawTx atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, ok := outbox.TxFromContext(r.Context()); ok {
			sawTx.Add(1)
		}
		w.Header().Set("Set-Cookie", "a=b")
		w.WriteHeader(http.StatusAccepted)
	})
	mux := http.NewServeMux()
	mux.Handle("/optional", mw.Handler(h))
	mux.Handle("/required", mw.Require(h))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	f := &fixture{db: db, mw: mw, srv: srv}

	wantProblem(t, f.send(t, "POST", "/required", "alice", "", ""), http.StatusBadRequest, idempotency.ProblemKeyMissing)
	// Optional route without a key, and a method the middleware does not cover: untouched.
	for _, c := range []struct{ method, path, key string }{{"POST", "/optional", ""}, {"GET", "/required", `"k"`}, {"PUT", "/required", ""}} {
		r := f.send(t, c.method, c.path, "", c.key, "")
		if r.status != http.StatusAccepted || r.header.Get("Set-Cookie") != "a=b" || r.replayed() {
			t.Fatalf("%s %s passed through as %d %v", c.method, c.path, r.status, r.header)
		}
	}
	if sawTx.Load() != 0 || f.records(t) != 0 {
		t.Fatal("a pass-through request got a transaction or a record")
	}
	// With a key the required route runs in a transaction.
	if r := f.send(t, "POST", "/required", "alice", `"k"`, ""); r.status != http.StatusAccepted || sawTx.Load() != 1 || f.records(t) != 1 {
		t.Fatalf("keyed request: %d, tx=%d, records=%d", r.status, sawTx.Load(), f.records(t))
	}
}

func TestOwnerFailures(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idempotency.Config{Owner: func(r *http.Request) (string, error) {
		switch r.Header.Get("X-User") {
		case "":
			return "", idempotency.ErrNoOwner
		case "empty":
			return "", nil
		case "broken":
			return "", errors.New("session store down")
		}
		return r.Header.Get("X-User"), nil
	}}, nil)
	wantProblem(t, f.send(t, "POST", "/orders", "", `"k"`, "book"), http.StatusUnauthorized, idempotency.ProblemNoOwner)
	wantProblem(t, f.send(t, "POST", "/orders", "empty", `"k"`, "book"), http.StatusUnauthorized, idempotency.ProblemNoOwner)
	r := f.send(t, "POST", "/orders", "broken", `"k"`, "book")
	if r.status != http.StatusInternalServerError || r.header.Get("Content-Type") != "application/problem+json" {
		t.Fatalf("Owner error: %d %s", r.status, r.body)
	}
	if f.runs.Load() != 0 || f.records(t) != 0 {
		t.Fatal("a request without an owner ran or stored something")
	}
}

func TestStorePredicate(t *testing.T) {
	t.Parallel()
	status := func(db *testdb.DB, runs *atomic.Int64) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			code := 0
			fmt.Sscan(r.URL.Query().Get("status"), &code)
			if _, err := outbox.MustTx(r.Context()).Exec(r.Context(), `INSERT INTO `+db.Table("orders")+` (owner, item) VALUES ('alice', $1)`, r.URL.RawQuery); err != nil {
				t.Error(err)
			}
			w.WriteHeader(code)
			fmt.Fprintf(w, "status %d", code)
		})
	}
	f := newFixture(t, idempotency.Config{}, status)
	// A 4xx the handler produced is a result: stored, committed and replayed.
	for _, code := range []int{409, 404} {
		key := fmt.Sprintf(`"k%d"`, code)
		first := f.send(t, "POST", fmt.Sprintf("/x?status=%d", code), "alice", key, "")
		again := f.send(t, "POST", fmt.Sprintf("/x?status=%d", code), "alice", key, "")
		if first.status != code || again.status != code || !again.replayed() || !bytes.Equal(first.body, again.body) {
			t.Fatalf("%d: first %d, retry %d replayed=%v", code, first.status, again.status, again.replayed())
		}
	}
	// "Try again later" statuses and 3xx are not frozen: rolled back, and the retry runs.
	for _, code := range []int{429, 303, 503} {
		key := fmt.Sprintf(`"k%d"`, code)
		for i := 0; i < 2; i++ {
			r := f.send(t, "POST", fmt.Sprintf("/x?status=%d", code), "alice", key, "")
			if r.status != code || r.replayed() {
				t.Fatalf("%d attempt %d: %d replayed=%v", code, i, r.status, r.replayed())
			}
		}
		if n := f.count(t, `SELECT count(*) FROM `+f.db.Table("orders")+` WHERE item = $1`, fmt.Sprintf("status=%d", code)); n != 0 {
			t.Fatalf("%d: %d business rows kept; want 0 (rolled back)", code, n)
		}
	}
	if got := f.runs.Load(); got != 2+6 {
		t.Fatalf("handler ran %d times; want 8", got)
	}

	// A custom predicate: store only 201.
	g := newFixture(t, idempotency.Config{Store: func(s int) bool { return s == http.StatusCreated }}, status)
	g.send(t, "POST", "/x?status=400", "alice", `"k"`, "")
	if r := g.send(t, "POST", "/x?status=400", "alice", `"k"`, ""); r.replayed() || g.records(t) != 0 {
		t.Fatal("a 400 was stored although the predicate refuses it")
	}
}

func TestCanonicalJSONOption(t *testing.T) {
	t.Parallel()
	for _, canonical := range []bool{false, true} {
		t.Run(fmt.Sprint(canonical), func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, idempotency.Config{CanonicalJSON: canonical}, nil)
			first := f.send(t, "POST", "/orders", "alice", `"k"`, `{"item":"book","qty":1}`, "Content-Type", "application/json")
			again := f.send(t, "POST", "/orders", "alice", `"k"`, "{ \"qty\": 1,\n  \"item\": \"book\" }", "Content-Type", "application/json; charset=utf-8")
			if canonical {
				if !again.replayed() || !bytes.Equal(again.body, first.body) {
					t.Fatalf("reordered JSON with CanonicalJSON: %d %s", again.status, again.body)
				}
			} else {
				wantProblem(t, again, http.StatusUnprocessableEntity, idempotency.ProblemKeyReused)
			}
			// A different value is a different request either way.
			wantProblem(t, f.send(t, "POST", "/orders", "alice", `"k"`, `{"item":"book","qty":2}`, "Content-Type", "application/json"),
				http.StatusUnprocessableEntity, idempotency.ProblemKeyReused)
		})
	}
}

func TestHandlerCannotEndTheTransaction(t *testing.T) {
	t.Parallel()
	leakedc := make(chan pgx.Tx, 1)
	f := newFixture(t, idempotency.Config{}, func(db *testdb.DB, runs *atomic.Int64) http.Handler {
		inner := orderHandler(db.Table("orders"), runs)
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			tx := outbox.MustTx(r.Context())
			leakedc <- tx
			if err := tx.Commit(r.Context()); !errors.Is(err, outbox.ErrTxManaged) {
				t.Errorf("Commit = %v; want ErrTxManaged", err)
			}
			if err := tx.Rollback(r.Context()); !errors.Is(err, outbox.ErrTxManaged) {
				t.Errorf("Rollback = %v; want ErrTxManaged", err)
			}
			// Savepoints still work inside the request transaction.
			err := pgx.BeginFunc(r.Context(), tx, func(sp pgx.Tx) error {
				_, err := sp.Exec(r.Context(), `INSERT INTO `+db.Table("orders")+` (owner, item) VALUES ('alice', 'savepoint')`)
				return err
			})
			if err != nil {
				t.Error(err)
			}
			inner(w, r)
		})
	})
	if r := f.send(t, "POST", "/orders", "alice", `"k"`, "book"); r.status != http.StatusCreated {
		t.Fatalf("%d %s", r.status, r.body)
	}
	if f.orders(t) != 2 || f.records(t) != 1 {
		t.Fatalf("orders=%d records=%d; want 2, 1", f.orders(t), f.records(t))
	}
	// A reference kept past the handler's return cannot reach the pooled connection.
	leaked := <-leakedc
	if _, err := leaked.Exec(context.Background(), `INSERT INTO `+f.db.Table("orders")+` (owner, item) VALUES ('alice', 'late')`); !errors.Is(err, pgx.ErrTxClosed) {
		t.Fatalf("Exec on a leaked transaction = %v; want ErrTxClosed", err)
	}
	if err := leaked.QueryRow(context.Background(), `SELECT 1`).Scan(new(int)); !errors.Is(err, pgx.ErrTxClosed) {
		t.Fatalf("QueryRow on a leaked transaction = %v; want ErrTxClosed", err)
	}
	if f.orders(t) != 2 {
		t.Fatal("a leaked transaction wrote after the request")
	}
}

// When storing the record fails, the business writes must not commit: here a rogue writer
// (the handler itself) puts a record for the key in place, so the middleware's insert hits a
// unique violation and the pipelined COMMIT must not run.
func TestStoreFailureRollsBackEverything(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idempotency.Config{RetryAfter: 3 * time.Second}, func(db *testdb.DB, runs *atomic.Int64) http.Handler {
		inner := orderHandler(db.Table("orders"), runs)
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, err := outbox.MustTx(r.Context()).Exec(r.Context(), `INSERT INTO `+db.Table("idempotency_record")+` (owner, idem_key, fingerprint, status, expires_at)
				VALUES ('alice', 'k', '\x00', 200, now() + interval '1 hour')`)
			if err != nil {
				t.Error(err)
			}
			inner(w, r)
		})
	})
	r := f.send(t, "POST", "/orders", "alice", `"k"`, "book")
	wantProblem(t, r, http.StatusServiceUnavailable, idempotency.ProblemStorage)
	if r.header.Get("Retry-After") != "3" || r.header.Get("Location") != "" || r.header.Get("Set-Cookie") != "" {
		t.Fatalf("503 headers: %v", r.header)
	}
	if f.orders(t) != 0 || f.records(t) != 0 {
		t.Fatalf("after a failed store: %d orders, %d records; want none", f.orders(t), f.records(t))
	}
	if f.runs.Load() != 1 {
		t.Fatalf("handler ran %d times", f.runs.Load())
	}
}

func TestOutboxEventsShareTheTransaction(t *testing.T) {
	t.Parallel()
	var fail atomic.Bool
	var writer *outbox.Writer
	f := newFixture(t, idempotency.Config{}, func(db *testdb.DB, runs *atomic.Int64) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			msg := outbox.NewMessage([]byte(`{"order":"book"}`))
			msg.SetContext(r.Context())
			// A long-lived Watermill publisher finds the request transaction in the context.
			if err := writer.ContextPublisher().Publish("orders", msg); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			if fail.Load() {
				w.WriteHeader(http.StatusInternalServerError)
				return
			}
			w.WriteHeader(http.StatusAccepted)
		})
	})
	var err error
	if writer, err = outbox.NewWriter(outbox.Config{Schema: f.db.Schema}); err != nil {
		t.Fatal(err)
	}
	fail.Store(true)
	f.send(t, "POST", "/orders", "alice", `"k"`, "")
	if n := f.count(t, `SELECT count(*) FROM `+f.db.Table("outbox")); n != 0 {
		t.Fatalf("%d events survived a 500; want 0", n)
	}
	fail.Store(false)
	for i := 0; i < 3; i++ {
		if r := f.send(t, "POST", "/orders", "alice", `"k"`, ""); r.status != http.StatusAccepted {
			t.Fatalf("%d %s", r.status, r.body)
		}
	}
	if n := f.count(t, `SELECT count(*) FROM `+f.db.Table("outbox")); n != 1 {
		t.Fatalf("%d events after a success and two replays; want 1", n)
	}
}

// recordingMetrics counts outcomes.
type recordingMetrics struct {
	mu sync.Mutex
	n  map[idempotency.Outcome]int
}

func (m *recordingMetrics) Observe(o idempotency.Outcome, _ time.Duration) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.n[o]++
}

func TestMetricsOutcomes(t *testing.T) {
	t.Parallel()
	m := &recordingMetrics{n: map[idempotency.Outcome]int{}}
	f := newFixture(t, idempotency.Config{Metrics: m}, nil)
	f.send(t, "POST", "/orders", "alice", `"k"`, "book")
	f.send(t, "POST", "/orders", "alice", `"k"`, "book")
	f.send(t, "POST", "/orders", "alice", `"k"`, "pen")
	f.send(t, "POST", "/orders", "alice", `""`, "pen")
	want := map[idempotency.Outcome]int{idempotency.OutcomeStored: 1, idempotency.OutcomeReplayed: 1, idempotency.OutcomeMismatch: 1, idempotency.OutcomeRejected: 1}
	m.mu.Lock()
	defer m.mu.Unlock()
	if fmt.Sprint(m.n) != fmt.Sprint(want) {
		t.Fatalf("outcomes %v; want %v", m.n, want)
	}
}

func TestWaitInFlightLeavesLockTimeoutAlone(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idempotency.Config{WaitInFlight: time.Minute}, func(db *testdb.DB, runs *atomic.Int64) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			var v string
			if err := outbox.MustTx(r.Context()).QueryRow(r.Context(), `SELECT current_setting('lock_timeout')`).Scan(&v); err != nil {
				t.Error(err)
			}
			io.WriteString(w, v)
		})
	})
	var session string
	if err := f.db.Pool.QueryRow(context.Background(), `SELECT current_setting('lock_timeout')`).Scan(&session); err != nil {
		t.Fatal(err)
	}
	if r := f.send(t, "POST", "/x", "alice", `"k"`, ""); string(r.body) != session {
		t.Fatalf("the handler saw lock_timeout %q; the session has %q", r.body, session)
	}
}

func TestImplicitStatusAndSniffedTypeReplayAlike(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idempotency.Config{}, func(db *testdb.DB, runs *atomic.Int64) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			if r.URL.Path == "/html" {
				io.WriteString(w, "<html><body>done</body></html>") // no WriteHeader, no Content-Type
			} // "/empty": writes nothing at all
		})
	})
	for _, path := range []string{"/html", "/empty"} {
		first := f.send(t, "POST", path, "alice", `"`+path+`"`, "")
		again := f.send(t, "POST", path, "alice", `"`+path+`"`, "")
		if first.status != http.StatusOK || again.status != http.StatusOK || !again.replayed() || !bytes.Equal(first.body, again.body) ||
			first.header.Get("Content-Type") != again.header.Get("Content-Type") {
			t.Fatalf("%s: first %d %q %q, replay %d %q %q", path, first.status, first.header.Get("Content-Type"), first.body,
				again.status, again.header.Get("Content-Type"), again.body)
		}
	}
	if f.runs.Load() != 2 {
		t.Fatalf("handler ran %d times; want 2", f.runs.Load())
	}
}

// A handler that suppresses Content-Type sniffing (a nil Content-Type, as net/http documents)
// gets no Content-Type on its first response; the replay must not gain a sniffed one.
func TestSuppressedContentTypeReplaysAlike(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idempotency.Config{}, func(db *testdb.DB, runs *atomic.Int64) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			w.Header()["Content-Type"] = nil // net/http: do not sniff
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, "<html><body>created</body></html>")
		})
	})
	first := f.send(t, "POST", "/x", "alice", `"k"`, "")
	again := f.send(t, "POST", "/x", "alice", `"k"`, "")
	if !again.replayed() || !bytes.Equal(first.body, again.body) || f.runs.Load() != 1 {
		t.Fatalf("replay: %d replayed=%v %q (runs %d)", again.status, again.replayed(), again.body, f.runs.Load())
	}
	if _, ok := first.header["Content-Type"]; ok {
		t.Fatalf("first response has Content-Type %q; the handler suppressed it", first.header.Get("Content-Type"))
	}
	if ct, ok := again.header["Content-Type"]; ok {
		t.Fatalf("the replay has Content-Type %q; the first response had none", ct)
	}
}

// CanonicalJSON must never make two different requests one: bodies whose strings differ only in
// what a JSON decoder replaces by U+FFFD (lone surrogate escapes, invalid UTF-8 bytes) are
// different commands, and a key reused across them is refused, not replayed.
func TestCanonicalJSONKeepsLossyStringsApart(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idempotency.Config{CanonicalJSON: true}, func(db *testdb.DB, runs *atomic.Int64) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			w.WriteHeader(http.StatusCreated)
		})
	})
	for i, c := range [][2]string{
		{`{"item":"\ud800"}`, `{"item":"\udfff"}`},     // two lone surrogates
		{`{"item":"\ud800"}`, `{"item":"\ufffd"}`},     // a lone surrogate and U+FFFD itself
		{"{\"item\":\"\xff\"}", "{\"item\":\"\xfe\"}"}, // two invalid UTF-8 bytes
	} {
		key := fmt.Sprintf(`"k%d"`, i)
		first := f.send(t, "POST", "/orders", "alice", key, c[0], "Content-Type", "application/json")
		if first.status != http.StatusCreated {
			t.Fatalf("case %d: first: %d %s", i, first.status, first.body)
		}
		r := f.send(t, "POST", "/orders", "alice", key, c[1], "Content-Type", "application/json")
		wantProblem(t, r, http.StatusUnprocessableEntity, idempotency.ProblemKeyReused)
	}
	if n := f.runs.Load(); n != 3 {
		t.Fatalf("handler ran %d times; want 3", n)
	}
}
