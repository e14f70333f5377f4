package idempotency_test

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testdb"
)

// outcomeChan reports every outcome the middleware observes.
type outcomeChan chan idempotency.Outcome

func (c outcomeChan) Observe(o idempotency.Outcome, _ time.Duration) { c <- o }

// The client hangs up after the handler did its work but before the middleware stored the
// result: the request's context is cancelled, yet the result is stored (on a context detached
// from the request's), so the client's retry replays it and the handler ran once.
func TestClientGoneAfterHandlerFinishedStillStores(t *testing.T) {
	t.Parallel()
	outcomes := make(outcomeChan, 8)
	wrote := make(chan struct{})
	var hungUp atomic.Bool
	f := newFixture(t, idempotency.Config{Metrics: outcomes}, func(db *testdb.DB, runs *atomic.Int64) http.Handler {
		inner := orderHandler(db.Table("orders"), runs)
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			inner(w, r) // the order is written (not yet committed) and the response buffered
			if !hungUp.Load() {
				close(wrote)
				<-r.Context().Done() // the client is gone; the handler still returns normally
				hungUp.Store(true)
			}
		})
	})
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, "POST", f.srv.URL+"/orders", strings.NewReader("book"))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-User", "alice")
	req.Header.Set(idempotency.HeaderKey, `"k"`)
	go func() { <-wrote; cancel() }()
	if _, err := f.srv.Client().Do(req); !errors.Is(err, context.Canceled) {
		t.Fatalf("first request: %v; want the client's own cancellation", err)
	}
	if o := <-outcomes; o != idempotency.OutcomeStored {
		t.Fatalf("outcome after the client hung up: %s; want %s", o, idempotency.OutcomeStored)
	}
	r := f.send(t, "POST", "/orders", "alice", `"k"`, "book")
	if r.status != http.StatusCreated || !r.replayed() || f.runs.Load() != 1 || f.orders(t) != 1 {
		t.Fatalf("retry: %d replayed=%v runs=%d orders=%d", r.status, r.replayed(), f.runs.Load(), f.orders(t))
	}
}

// logRecords is a slog.Handler that keeps every record, for asserting on levels.
type logRecords struct {
	mu      sync.Mutex
	records []slog.Record
}

func (*logRecords) Enabled(context.Context, slog.Level) bool { return true }
func (l *logRecords) WithAttrs([]slog.Attr) slog.Handler     { return l }
func (l *logRecords) WithGroup(string) slog.Handler          { return l }
func (l *logRecords) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.records = append(l.records, r)
	return nil
}

// at returns the messages logged at level or above.
func (l *logRecords) at(level slog.Level) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var msgs []string
	for _, r := range l.records {
		if r.Level >= level {
			msgs = append(msgs, r.Message)
		}
	}
	return msgs
}

// keyedRequest is a POST /orders by alice with key "k", on ctx.
func keyedRequest(ctx context.Context) *http.Request {
	req := httptest.NewRequestWithContext(ctx, "POST", "/orders", strings.NewReader("book"))
	req.Header.Set("X-User", "alice")
	req.Header.Set(idempotency.HeaderKey, `"k"`)
	return req
}

// The client hangs up before the request's transaction begins (as a dropped connection does
// under load): nothing ran and nothing was stored, which is no storage failure — no ERROR
// record, the canceled outcome — while a real failure at the same step stays an ERROR.
func TestClientGoneBeforeBeginIsNotAStorageFailure(t *testing.T) {
	t.Parallel()
	logs := &logRecords{}
	outcomes := make(outcomeChan, 8)
	f := newFixture(t, idempotency.Config{Metrics: outcomes, Logger: slog.New(logs)}, nil)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	w := httptest.NewRecorder()
	f.srv.Config.Handler.ServeHTTP(w, keyedRequest(ctx))
	if errs := logs.at(slog.LevelWarn); len(errs) > 0 {
		t.Fatalf("a client that went away was logged at WARN or above: %q", errs)
	}
	if o := <-outcomes; o != idempotency.OutcomeCanceled {
		t.Fatalf("outcome %s; want %s", o, idempotency.OutcomeCanceled)
	}
	if len(logs.at(slog.LevelDebug)) != 1 {
		t.Fatalf("want one debug record saying the client went away, got %q", logs.at(slog.LevelDebug))
	}
	if w.Code != http.StatusServiceUnavailable || w.Header().Get("Retry-After") == "" || f.runs.Load() != 0 || f.records(t) != 0 {
		t.Fatalf("cancelled request: %d (Retry-After %q), runs %d, records %d; want 503 with Retry-After, nothing run or stored",
			w.Code, w.Header().Get("Retry-After"), f.runs.Load(), f.records(t))
	}

	// The same step failing for a reason of the storage's own: a closed pool.
	closed, err := pgxpool.New(context.Background(), f.db.Pool.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	closed.Close()
	failLogs := &logRecords{}
	mw, err := idempotency.New(idempotency.Config{Pool: closed, Schema: f.db.Schema, Owner: ownerFromHeader,
		Metrics: outcomes, Logger: slog.New(failLogs)})
	if err != nil {
		t.Fatal(err)
	}
	w = httptest.NewRecorder()
	mw.Handler(http.NotFoundHandler()).ServeHTTP(w, keyedRequest(context.Background()))
	if o := <-outcomes; o != idempotency.OutcomeStorageFail {
		t.Fatalf("outcome on a closed pool %s; want %s", o, idempotency.OutcomeStorageFail)
	}
	if errs := failLogs.at(slog.LevelError); len(errs) != 1 || w.Code != http.StatusServiceUnavailable {
		t.Fatalf("a closed pool: %d, ERROR records %q; want 503 and one ERROR record", w.Code, errs)
	}
}
