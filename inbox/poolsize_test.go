package inbox_test

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
)

// smallPool is a pool of n connections on the test's schema.
func smallPool(t *testing.T, db *testdb.DB, n int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = db.Schema
	cfg.MaxConns = n
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// Handlers that also take a connection from the inbox's pool (a read through pool.QueryRow, a
// pool.Begin of their own) while every message in flight holds one: with a pool of 2 and two
// messages at once, each holds a connection for its transaction and waits for the other one
// forever. The inbox keeps one connection of its pool free for them, so both messages go
// through, one after the other.
func TestHandlersUsingThePoolCannotExhaustIt(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	createEffectTable(t, db)
	pool := smallPool(t, db, 2)
	ib, err := inbox.New(inbox.Config{Pool: pool, Schema: db.Schema, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	fx := &fixture{t: t, db: db}
	var inHandler, most atomic.Int32
	var busy atomic.Bool
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		n := inHandler.Add(1)
		defer inHandler.Add(-1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		if err := fx.applyEffect(msg, ""); err != nil {
			return nil, err
		}
		// The first handler waits until the other message is in its handler too, or waits for
		// a connection slot: only then is the pool as busy as it gets.
		deadline := time.Now().Add(60 * time.Second)
		for !busy.Load() && inHandler.Load() < 2 && inbox.WaitingForConn(ib) == 0 {
			if time.Now().After(deadline) {
				t.Error("the other message neither entered its handler nor waits for a connection")
				break
			}
			time.Sleep(time.Millisecond)
		}
		busy.Store(true)
		// The bound only keeps a deadlock from hanging the test.
		ctx, cancel := context.WithTimeout(msg.Context(), 10*time.Second)
		defer cancel()
		var one int
		return nil, pool.QueryRow(ctx, `SELECT 1`).Scan(&one)
	})
	msgs := []*message.Message{outbox.NewMessage([]byte("a")), outbox.NewMessage([]byte("b"))}
	var wg sync.WaitGroup
	errs := make([]error, len(msgs))
	for i, m := range msgs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = h(m)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("message %d, whose handler used the pool while the other message held a connection: %v", i, err)
		}
	}
	for _, m := range msgs {
		if n := fx.effects(m.UUID); n != 1 {
			t.Errorf("message %s: %d effects; want 1", m.UUID, n)
		}
	}
	if most.Load() != 1 {
		t.Errorf("%d handlers ran at once on a pool of 2; want 1, leaving a connection for the handler", most.Load())
	}
}

// A pool of one connection cannot hold a message's transaction and leave one for its
// handler: New refuses it and says what to change.
func TestPoolOfOneIsRefused(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, err := inbox.New(inbox.Config{Pool: smallPool(t, db, 1), Schema: db.Schema, Consumer: "billing"})
	if err == nil || !strings.Contains(err.Error(), "MaxConns is 1") || !strings.Contains(err.Error(), "pool_max_conns") {
		t.Fatalf("New with a pool of 1: %v; want a refusal naming MaxConns and pool_max_conns", err)
	}
}
