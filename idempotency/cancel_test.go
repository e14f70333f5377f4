package idempotency_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

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
