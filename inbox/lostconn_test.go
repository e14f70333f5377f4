package inbox_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
)

// The router path of issue 23's "a lost backend connection with MaxAttempts = 1 poisons
// nothing". Under the router the inbox counts no attempts: Watermill's Retry and PoisonQueue
// do, and they see every error the middleware returns. What the middleware owes them is that
// a connection lost mid-statement is returned as an error (the message is not acknowledged),
// leaves nothing committed, is not mistaken for poison (inbox.ShouldRetry retries it), and
// that the next attempt runs in a fresh transaction on a healthy connection and applies the
// message once.
func TestMiddlewareLostConnectionIsRetriedNotPoisoned(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	px := testdb.NewProxy(t, f.db)
	ib := f.newInbox(func(c *inbox.Config) { c.Pool = px.Pool(t, f.db, 4) })
	var (
		mu       sync.Mutex
		pids     []uint32
		attempts []error
	)
	var cutter sync.WaitGroup
	t.Cleanup(cutter.Wait)
	cutErr := make(chan error, 1)
	h := func(msg *message.Message) ([]*message.Message, error) {
		if err := f.applyEffect(msg, ""); err != nil {
			return nil, err
		}
		tx := outbox.MustTx(msg.Context())
		pid := tx.Conn().PgConn().PID()
		mu.Lock()
		pids = append(pids, pid)
		first := len(pids) == 1
		mu.Unlock()
		if !first {
			return nil, nil
		}
		cutter.Add(1)
		go func() {
			defer cutter.Done()
			cutErr <- px.CutWhileSleeping(context.Background(), f.db, pid)
		}()
		if _, err := tx.Exec(msg.Context(), `SELECT pg_sleep(60)`); err != nil {
			return nil, err
		}
		return nil, errors.New("pg_sleep(60) returned although its connection was cut")
	}
	// Record what each attempt returned to Retry.
	recorded := func(next message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := next(msg)
			mu.Lock()
			attempts = append(attempts, err)
			mu.Unlock()
			return out, err
		}
	}
	retry := middleware.Retry{MaxRetries: 1, InitialInterval: time.Millisecond, ShouldRetry: inbox.ShouldRetry}
	msg := outbox.NewMessage([]byte("x"))
	if _, err := retry.Middleware(recorded(ib.Middleware(h)))(msg); err != nil {
		t.Fatalf("the retry after a lost connection failed: %v", err)
	}
	if err := <-cutErr; err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(attempts) != 2 || attempts[0] == nil || attempts[1] != nil {
		t.Fatalf("attempts returned %v; want the lost connection's error, then success", attempts)
	}
	if inbox.IsPoison(attempts[0]) {
		t.Fatalf("a lost connection is reported as poison: %v", attempts[0])
	}
	if pids[0] == pids[1] {
		t.Fatalf("the retry ran on the lost connection's backend %d", pids[0])
	}
	if f.effects(msg.UUID) != 1 || f.dedupRows() != 1 {
		t.Fatalf("effects %d, dedup rows %d; want 1 and 1", f.effects(msg.UUID), f.dedupRows())
	}
}
