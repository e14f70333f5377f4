package engine

import (
	"context"
	"runtime"
	"sync"
	"sync/atomic"
	"weak"

	"github.com/jackc/pgx/v5/pgxpool"
)

// slots bounds the transactions that hold a connection of one pool to the pool's MaxConns − 1,
// across every consumer on that pool. The connection left over is what makes a handler that
// takes one more connection from the same pool safe: without it, a full set of transactions
// in flight would each hold a connection and wait for another, forever.
type slots struct {
	ch      chan struct{}
	waiting atomic.Int64 // transactions waiting for a slot, for tests
}

// acquire takes a slot, waiting while every slot is taken, until ctx ends.
func (s *slots) acquire(ctx context.Context) error {
	select {
	case s.ch <- struct{}{}:
		return nil
	default:
	}
	s.waiting.Add(1)
	defer s.waiting.Add(-1)
	select {
	case s.ch <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (s *slots) release() { <-s.ch }

// WaitingForSlot is the number of transactions waiting for a connection slot of the Runner's
// pool, for tests.
func (r *Runner) WaitingForSlot() int { return int(r.slots.waiting.Load()) }

// poolSlots holds the slots of each pool a Runner was built on. The pools are held weakly: a
// pool that is no longer referenced takes its entry with it.
var poolSlots = struct {
	sync.Mutex
	m map[weak.Pointer[pgxpool.Pool]]*slots
}{m: map[weak.Pointer[pgxpool.Pool]]*slots{}}

// slotsOf returns the slots shared by every Runner on pool (MaxConns ≥ 2: Check).
func slotsOf(pool *pgxpool.Pool) *slots {
	key := weak.Make(pool)
	poolSlots.Lock()
	defer poolSlots.Unlock()
	if s := poolSlots.m[key]; s != nil {
		return s
	}
	s := &slots{ch: make(chan struct{}, max(1, pool.Config().MaxConns-1))}
	poolSlots.m[key] = s
	runtime.AddCleanup(pool, func(key weak.Pointer[pgxpool.Pool]) {
		poolSlots.Lock()
		delete(poolSlots.m, key)
		poolSlots.Unlock()
	}, key)
	return s
}
