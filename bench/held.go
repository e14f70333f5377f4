package main

// drain_held_snapshot and drain_held_lock: the relay at full load while something an operator
// does holds the outbox back — a long REPEATABLE READ transaction (its snapshot keeps every row
// the relay deletes as a dead tuple), or a session holding SHARE UPDATE EXCLUSIVE (the lock of
// VACUUM, ANALYZE and CREATE INDEX CONCURRENTLY).

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

const (
	heldBefore  = 10 * time.Second
	heldFor     = 30 * time.Second
	heldAfter   = 10 * time.Second
	heldWriters = 16
)

// benchDrainHeldSnapshot: 16 writers at full speed (one event per transaction) and one relay
// for 50 s; from 10 s to 40 s a REPEATABLE READ transaction holds its snapshot open. Delivered
// rate, claim times and the outbox's dead tuples in each window.
func benchDrainHeldSnapshot(ctx context.Context, e *env) ([]result, error) {
	return benchHeld(ctx, e, "drain_held_snapshot", func(ctx context.Context, pool *pgxpool.Pool, outboxT string) (func(), error) {
		tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
		if err != nil {
			return nil, err
		}
		var n int64 // the first statement takes the snapshot
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM `+outboxT).Scan(&n); err != nil {
			_ = tx.Rollback(ctx)
			return nil, err
		}
		return func() { _ = tx.Rollback(ctx) }, nil
	})
}

// benchDrainHeldLock: as drain_held_snapshot, with a session holding SHARE UPDATE EXCLUSIVE on
// the outbox from 10 s to 40 s.
func benchDrainHeldLock(ctx context.Context, e *env) ([]result, error) {
	return benchHeld(ctx, e, "drain_held_lock", func(ctx context.Context, pool *pgxpool.Pool, outboxT string) (func(), error) {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return nil, err
		}
		if _, err := tx.Exec(ctx, `LOCK TABLE `+outboxT+` IN SHARE UPDATE EXCLUSIVE MODE`); err != nil {
			_ = tx.Rollback(ctx)
			return nil, err
		}
		return func() { _ = tx.Rollback(ctx) }, nil
	})
}

type heldWindow struct {
	name       string
	delivered  float64 // ev/s
	written    float64 // ev/s
	claimP50   float64 // ms
	claimP99   float64 // ms
	deadTuples int64   // at the end of the window
	backlog    int64   // outbox rows at the end of the window
}

func benchHeld(ctx context.Context, e *env, scenario string, hold func(context.Context, *pgxpool.Pool, string) (release func(), err error)) ([]result, error) {
	pool, schema, err := e.freshSchema(ctx, scenario)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	outboxT := pgsql.Table(schema, "outbox")
	tracer := &claimTracer{}
	rcfg := pool.Config().Copy()
	rcfg.ConnConfig.Tracer = tracer
	rpool, err := pgxpool.NewWithConfig(ctx, rcfg)
	if err != nil {
		return nil, err
	}
	defer rpool.Close()
	topic := benchTopic(scenario)
	rcv, err := newReceiver(ctx, e.brokers, topic)
	if err != nil {
		return nil, err
	}
	defer rcv.stop()
	stopRelay, err := runRelay(ctx, e, rpool, schema, relay.Config{InstanceID: scenario})
	if err != nil {
		return nil, err
	}
	defer stopRelay()
	w, err := outbox.NewWriter(outbox.Config{Schema: schema})
	if err != nil {
		return nil, err
	}
	wctx, stopWriters := context.WithCancel(ctx)
	defer stopWriters()
	var written atomic.Int64
	var wg sync.WaitGroup
	errc := make(chan error, heldWriters)
	for g := range heldWriters {
		wg.Go(func() {
			for i := g; wctx.Err() == nil; i += heldWriters {
				msgs := keyedMessages(i, 1, 50)
				if err := pgx.BeginFunc(wctx, pool, func(tx pgx.Tx) error { return w.WriteTx(wctx, tx, topic, msgs...) }); err != nil {
					if wctx.Err() == nil {
						errc <- err
					}
					return
				}
				written.Add(1)
			}
		})
	}
	deadTuples := func() int64 {
		var n int64
		if err := pool.QueryRow(ctx, `SELECT coalesce(n_dead_tup, 0) FROM pg_stat_all_tables WHERE relid = $1::regclass`, outboxT).Scan(&n); err != nil {
			e.log.Error("dead tuples", "err", err)
		}
		return n
	}
	// window measures one phase; the sleep is the measurement.
	window := func(name string, d time.Duration) heldWindow {
		from, r0, w0 := time.Now(), rcv.count(), written.Load()
		time.Sleep(d)
		to := time.Now()
		secs := to.Sub(from).Seconds()
		claims := tracer.between(from, to)
		hw := heldWindow{name: name, delivered: float64(rcv.count()-r0) / secs, written: float64(written.Load()-w0) / secs, deadTuples: deadTuples()}
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+outboxT).Scan(&hw.backlog); err != nil {
			e.log.Error("backlog", "err", err)
		}
		if len(claims) > 0 {
			hw.claimP50, hw.claimP99 = ms(percentile(claims, 50)), ms(percentile(claims, 99))
		}
		fmt.Fprintf(os.Stderr, "  %s %-6s delivered %.0f ev/s (written %.0f ev/s), %d claims p50 %.2f ms p99 %.2f ms, dead tuples %d, backlog %d\n",
			scenario, name, hw.delivered, hw.written, len(claims), hw.claimP50, hw.claimP99, hw.deadTuples, hw.backlog)
		return hw
	}
	wins := []heldWindow{window("before", heldBefore)}
	release, err := hold(ctx, pool, outboxT)
	if err != nil {
		return nil, err
	}
	wins = append(wins, window("during", heldFor))
	release()
	wins = append(wins, window("after", heldAfter))
	stopWriters()
	wg.Wait()
	close(errc)
	if err := <-errc; err != nil {
		return nil, err
	}
	if err := rcv.waitFor(ctx, int(written.Load()), 5*time.Minute); err != nil {
		return nil, err
	}
	var out []result
	for _, hw := range wins {
		out = append(out,
			result{Scenario: scenario, System: "onceflow-" + hw.name, Value: hw.delivered, Unit: "ev/s", Versus: fmt.Sprintf("written %.0f ev/s, backlog %d", hw.written, hw.backlog)},
			result{Scenario: scenario + "_claim_p99", System: "onceflow-" + hw.name, Value: hw.claimP99, Unit: "ms", Versus: fmt.Sprintf("p50 %.2f ms", hw.claimP50)},
			result{Scenario: scenario + "_dead_tuples", System: "onceflow-" + hw.name, Value: float64(hw.deadTuples), Unit: "rows", Versus: "-"})
	}
	// The writers' rate moves with the machine's load: delivery keeps its rate when it keeps up
	// with them, so the figure is delivered ÷ written while the outbox is held.
	out = append(out,
		result{Scenario: scenario + "_ratio", System: "during-delivered-vs-written", Value: wins[1].delivered / wins[1].written, Unit: "×", Versus: "-", Target: "≥ 0.95"},
		result{Scenario: scenario + "_ratio", System: "during-vs-before", Value: wins[1].delivered / wins[0].delivered, Unit: "×", Versus: "-"})
	slices.SortStableFunc(out, func(a, b result) int {
		switch {
		case a.Scenario < b.Scenario:
			return -1
		case a.Scenario > b.Scenario:
			return 1
		}
		return 0
	})
	return out, nil
}
