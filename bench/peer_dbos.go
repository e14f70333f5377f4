package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/dbos-inc/dbos-transact-golang/dbos"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/embedded"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
	"github.com/onceflow/onceflow/saga"
)

// The saga_vs_dbos row: the same three-step work — each step one INSERT into a business
// table — started by the same writers in a business transaction that also inserts the order
// row, as a DBOS Transact workflow of three RunAsTransaction steps and as an onceflow saga,
// on the same PostgreSQL server (fsync on), in the same run.
//
// Every system is measured by the same harness (runPeers, rounds alternating between the
// systems): peerSagas units started by peerSagaWriters writers in 3 rounds (throughput:
// units ÷ the rounds' time, each round from its first start to its last completion;
// "started in": the writers' own time), then peerLatencySagas units started at
// peerLatencyRate per second by one writer in 5 rounds (latency: the writer's call →
// completion).
// "Completed" is taken, for every system, inside the transaction that completes the unit,
// after its last write and before its COMMIT: the last step's transaction function for DBOS,
// the saga's OnCompleted hook for onceflow (both run in that transaction). Each system's
// final COMMIT (one durable flush) is thus left out alike.
const (
	peerSagas        = 3000
	peerSagaWriters  = 8
	peerLatencyRate  = 100
	peerLatencySagas = 500
)

// peerSteps are the three steps' names; step i inserts (n, peerSteps[i]) into step_effect.
var peerSteps = []string{"reserve", "charge", "confirm"}

const (
	peerOrderSQL  = `INSERT INTO orders (n, payload) VALUES ($1, $2)`
	peerEffectSQL = `INSERT INTO step_effect (n, step) VALUES ($1, $2)`
	peerTablesSQL = `CREATE TABLE orders (n bigint PRIMARY KEY, payload bytea NOT NULL);
CREATE TABLE step_effect (n bigint NOT NULL, step text NOT NULL, PRIMARY KEY (n, step))`
)

func benchSagaVsDBOS(ctx context.Context, e *env) ([]result, error) {
	setups := []struct {
		name, what string
		setup      func(context.Context, *env) (*peerSystem, error)
	}{
		{"dbos", "DBOS workflow enqueued in the business tx (WithEnqueueTransaction), queue defaults (polled every 1 s)", func(ctx context.Context, e *env) (*peerSystem, error) {
			return setupDBOS(ctx, e, dbosEnqueue, 0)
		}},
		{"dbos-queue-10ms", "the same, the queue polled every 10 ms", func(ctx context.Context, e *env) (*peerSystem, error) {
			return setupDBOS(ctx, e, dbosEnqueue, 10*time.Millisecond)
		}},
		{"dbos-direct", "DBOS workflow started by the writer (RunWorkflow), order row in step 1's transaction", func(ctx context.Context, e *env) (*peerSystem, error) {
			return setupDBOS(ctx, e, dbosDirect, 0)
		}},
		{"onceflow", "onceflow saga, three local steps run in the business tx (StartTx with RunLocalSteps)", func(ctx context.Context, e *env) (*peerSystem, error) {
			return setupOnceflowSaga(ctx, e, onceflowLocal)
		}},
		{"onceflow-deferred", "onceflow saga, three local steps run by the orchestrator (StartTx; its timer, every 200 ms)", func(ctx context.Context, e *env) (*peerSystem, error) {
			return setupOnceflowSaga(ctx, e, onceflowDeferred)
		}},
		{"onceflow-remote", "onceflow saga, three remote steps (relay, kfake, batched participants and orchestrator)", func(ctx context.Context, e *env) (*peerSystem, error) {
			return setupOnceflowSaga(ctx, e, onceflowRemote)
		}},
	}
	var systems []*peerSystem
	for _, s := range setups {
		if !peerSelected(s.name) {
			continue
		}
		sys, err := s.setup(ctx, e)
		if err != nil {
			for _, up := range systems {
				_ = up.stop()
			}
			return nil, fmt.Errorf("%s: %w", s.name, err)
		}
		sys.name, sys.what = s.name, s.what
		systems = append(systems, sys)
	}
	plan := peerPlan{row: "saga_vs_dbos", writers: peerSagaWriters, rounds: 3, perRound: peerSagas / 3,
		latencyRounds: 5, perLatency: peerLatencySagas / 5, rate: peerLatencyRate}
	if err := runPeers(ctx, plan, systems); err != nil {
		return nil, err
	}
	by := map[string]*peerSystem{}
	for _, s := range systems {
		by[s.name] = s
		fmt.Fprintf(os.Stderr, "  saga_vs_dbos %-17s %7.0f sagas/s, started in %s, p50 %s p99 %s, %.2f tx/saga, WAL %.1f KiB/saga  (%s)\n",
			s.name, s.rate(), s.written.Round(time.Millisecond), percentile(s.latency, 50).Round(10*time.Microsecond),
			percentile(s.latency, 99).Round(10*time.Microsecond), s.commitsPerUnit, s.walPerUnit(), s.what)
	}
	of, db := by["onceflow"], by["dbos"]
	var out []result
	for _, s := range systems {
		r := result{Scenario: "saga_vs_dbos", System: s.name, Value: s.rate(), Unit: "sagas/s", HigherIsBetter: true}
		if db != nil && s != db {
			r.Versus = fmt.Sprintf("%.2f× dbos", s.rate()/db.rate())
		}
		if of != nil && db != nil && s == of {
			r.Target = "≥ 1.0× dbos " + mark(of.rate() >= db.rate())
		}
		out = append(out, r)
	}
	for _, s := range systems {
		out = append(out, result{Scenario: "saga_vs_dbos_started_in", System: s.name, Value: s.written.Seconds(), Unit: "s", Versus: "-"})
	}
	for _, s := range systems {
		out = append(out, result{Scenario: "saga_vs_dbos_p50", System: s.name, Value: ms(percentile(s.latency, 50)), Unit: "ms", Versus: "-"})
	}
	for _, s := range systems {
		r := result{Scenario: "saga_vs_dbos_p99", System: s.name, Value: ms(percentile(s.latency, 99)), Unit: "ms", Versus: "-"}
		if of != nil && db != nil && s == of {
			r.Target = fmt.Sprintf("lower than dbos at %d/s %s", peerLatencyRate, mark(percentile(of.latency, 99) < percentile(db.latency, 99)))
		}
		out = append(out, r)
	}
	for _, s := range systems {
		out = append(out, result{Scenario: "saga_vs_dbos_tx", System: s.name, Value: s.commitsPerUnit, Unit: "tx/saga", Versus: "-", Target: "read-only included"})
	}
	for _, s := range systems {
		out = append(out, result{Scenario: "saga_vs_dbos_wal", System: s.name, Value: s.walPerUnit(), Unit: "KiB/saga", Versus: "-"})
	}
	return out, nil
}

// checkSagaEffects verifies that want units each inserted their order row once and each of
// their three effects once.
func checkSagaEffects(pool *pgxpool.Pool) func(ctx context.Context, want int) error {
	return func(ctx context.Context, want int) error {
		return pollUntil(ctx, 10*time.Second, func() error {
			var orders, effects, distinct int
			if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM orders), count(*), count(DISTINCT (n, step)) FROM step_effect`).Scan(&orders, &effects, &distinct); err != nil {
				return err
			}
			if orders != want || effects != 3*want || distinct != effects {
				return fmt.Errorf("%d orders, %d effects (%d distinct), want %d and %d", orders, effects, distinct, want, 3*want)
			}
			return nil
		})
	}
}

// How the DBOS workflow is started.
const (
	// dbosEnqueue: the writer's business transaction inserts the order row and enqueues the
	// workflow in that transaction (dbos.WithEnqueueTransaction): the start commits with the
	// order, as onceflow's StartTx does. A queue runner dequeues and runs it.
	dbosEnqueue = iota
	// dbosDirect: the writer calls dbos.RunWorkflow (a durable workflow row, then the
	// workflow runs in a goroutine of this process); the order row is written in the first
	// step's transaction, so it commits with that step's effect and checkpoint.
	dbosDirect
)

type dbosOrder struct {
	N     int  `json:"n"`
	Order bool `json:"order"` // write the order row in the first step
}

// setupDBOS starts a DBOS context on a database of its own, its system database, which also
// holds the business tables: WithEnqueueTransaction needs the business transaction on the
// system database, and a data source on the system database's own pool makes each
// RunAsTransaction one transaction (the step's writes and its checkpoint), DBOS's cheapest
// durable step. Defaults otherwise (JSON serializer, default schema "dbos"); the queue's
// polling interval is DBOS's default (1 s) unless poll is set.
func setupDBOS(ctx context.Context, e *env, mode int, poll time.Duration) (*peerSystem, error) {
	pool, _, err := e.freshDatabase(ctx, "dbos")
	if err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, peerTablesSQL); err != nil {
		pool.Close()
		return nil, err
	}
	dctx, err := dbos.NewContext(ctx, dbos.Config{AppName: "onceflow-bench", SystemDBPool: pool, Logger: slog.New(quietOnCancel{e.log.Handler()})})
	if err != nil {
		pool.Close()
		return nil, err
	}
	fail := func(err error) (*peerSystem, error) {
		_ = dbos.Shutdown(dctx, 10*time.Second)
		pool.Close()
		return nil, err
	}
	ds, err := dbos.NewDataSource(dctx, pool, dbos.WithDataSourceName("bench"))
	if err != nil {
		return fail(err)
	}
	done := newCompletions()
	checkout := func(ctx dbos.Context, in dbosOrder) (int, error) {
		for i, step := range peerSteps {
			last := i == len(peerSteps)-1
			order := in.Order && i == 0
			_, err := dbos.RunAsTransaction(ctx, ds, func(ctx context.Context, tx dbos.Tx) (int, error) {
				if order {
					if _, err := tx.Exec(ctx, peerOrderSQL, in.N, benchPayload); err != nil {
						return 0, err
					}
				}
				if _, err := tx.Exec(ctx, peerEffectSQL, in.N, step); err != nil {
					return 0, err
				}
				if last {
					done.mark(in.N)
				}
				return i, nil
			}) // RunAsTransaction names the step after the function; the name is not used here
			if err != nil {
				return 0, err
			}
		}
		return in.N, nil
	}
	dbos.RegisterWorkflow(dctx, checkout, dbos.WithWorkflowName("checkout"))
	const queueName = "checkout"
	var qopts []dbos.QueueOption
	if poll > 0 {
		qopts = append(qopts, dbos.WithQueueBasePollingInterval(poll))
	}
	if _, err := dbos.RegisterQueue(dctx, queueName, qopts...); err != nil {
		return fail(err)
	}
	if err := dbos.Launch(dctx); err != nil {
		return fail(err)
	}
	p := &peerSystem{done: done, pool: pool, check: checkSagaEffects(pool), stop: func() error {
		err := dbos.Shutdown(dctx, 30*time.Second)
		pool.Close()
		return err
	}}
	switch mode {
	case dbosEnqueue:
		p.start = func(ctx context.Context, n int) error {
			return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, peerOrderSQL, n, benchPayload); err != nil {
					return err
				}
				_, err := dbos.Enqueue[int](dctx, queueName, "checkout", dbosOrder{N: n}, dbos.WithEnqueueTransaction(tx))
				return err
			})
		}
	case dbosDirect:
		p.start = func(_ context.Context, n int) error {
			_, err := dbos.RunWorkflow(dctx, checkout, dbosOrder{N: n, Order: true})
			return err
		}
	}
	return p, nil
}

// quietOnCancel drops the log records DBOS writes about its own shutdown (errors that are the
// cancellation of its context: its queue runner's last polls), and passes every other one.
type quietOnCancel struct{ slog.Handler }

func (h quietOnCancel) Handle(ctx context.Context, r slog.Record) error {
	cancelled := false
	r.Attrs(func(a slog.Attr) bool {
		err, ok := a.Value.Any().(error)
		cancelled = ok && (errors.Is(err, context.Canceled) || strings.HasSuffix(err.Error(), context.Canceled.Error()))
		return !cancelled
	})
	if cancelled {
		return nil
	}
	return h.Handler.Handle(ctx, r)
}

func (h quietOnCancel) WithAttrs(as []slog.Attr) slog.Handler {
	return quietOnCancel{h.Handler.WithAttrs(as)}
}

func (h quietOnCancel) WithGroup(name string) slog.Handler {
	return quietOnCancel{h.Handler.WithGroup(name)}
}

// How the onceflow saga runs its steps.
const (
	onceflowLocal    = iota // three Local steps, run in StartTx's transaction (RunLocalSteps)
	onceflowDeferred        // three Local steps, run by the orchestrator's timer after the start
	onceflowRemote          // three remote steps: relay, kfake, batched participants and orchestrator
)

// setupOnceflowSaga builds the onceflow side on a database of its own: the definition, the
// orchestrator (its Run loop fires timers), and for remote steps the relay, a kfake cluster
// with peerSagaWriters partitions per topic, and batched consumers (as the saga row's
// batched path).
func setupOnceflowSaga(ctx context.Context, e *env, mode int) (*peerSystem, error) {
	pool, schema, err := e.freshOnceflowDatabase(ctx, "saga_onceflow")
	if err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, peerTablesSQL); err != nil {
		pool.Close()
		return nil, err
	}
	w, err := outbox.NewWriter(outbox.Config{Schema: schema})
	if err != nil {
		pool.Close()
		return nil, err
	}
	done := newCompletions()
	build := func(d sagaBenchData) (any, error) { return d, nil }
	var steps []*saga.StepDef[sagaBenchData]
	for _, s := range peerSteps {
		st := saga.Step[sagaBenchData](s)
		if mode == onceflowRemote {
			st.Send("peer."+s, build)
			if s != "confirm" {
				st.Compensate("peer.undo."+s, build)
			}
		} else {
			step := s
			st.Local(func(ctx context.Context, tx pgx.Tx, d *sagaBenchData) error {
				_, err := tx.Exec(ctx, peerEffectSQL, d.N, step)
				return err
			})
		}
		steps = append(steps, st)
	}
	def, err := saga.Define("peer", 1, steps, saga.OnCompleted(func(_ context.Context, _ pgx.Tx, d *sagaBenchData) error {
		done.mark(d.N)
		return nil
	}))
	if err != nil {
		pool.Close()
		return nil, err
	}
	orch, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: pool, Schema: schema, Writer: w, Logger: e.log})
	if err != nil {
		pool.Close()
		return nil, err
	}
	if err := saga.Register(orch, def); err != nil {
		pool.Close()
		return nil, err
	}
	runs := []func(context.Context) error{orch.Run}
	var cleanups []func()
	if mode == onceflowRemote {
		k, err := embedded.StartKafka(peerSagaWriters)
		if err != nil {
			pool.Close()
			return nil, err
		}
		cleanups = append(cleanups, k.Stop)
		brokers := k.Brokers()
		sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: brokers})
		if err != nil {
			k.Stop()
			pool.Close()
			return nil, err
		}
		cleanups = append(cleanups, func() { _ = sink.Close() })
		r, err := relay.New(relay.Config{Pool: pool, Sink: sink, Schema: schema, Logger: e.log})
		if err != nil {
			return nil, errors.Join(err, closeAll(pool, cleanups))
		}
		runs = append(runs, r.Run)
		consume := func(group string, p inbox.BatchProcessor, topics ...string) error {
			c, err := inboxkafka.NewBatchConsumer(inboxkafka.BatchConfig{Brokers: brokers, Group: group, Topics: topics, Processor: p, Logger: e.log})
			if err == nil {
				runs = append(runs, c.Run)
			}
			return err
		}
		for _, s := range peerSteps {
			part, err := saga.NewParticipant(saga.ParticipantConfig{Pool: pool, Schema: schema, Consumer: "peer-" + s, Writer: w, Logger: e.log})
			if err != nil {
				return nil, errors.Join(err, closeAll(pool, cleanups))
			}
			step := s
			action := func(ctx context.Context, tx pgx.Tx, d sagaBenchData) (struct{}, error) {
				_, err := tx.Exec(ctx, peerEffectSQL, d.N, step)
				return struct{}{}, err
			}
			if err := consume("peer-"+s, saga.ActionProcessor(part, action), "peer."+s); err != nil {
				return nil, errors.Join(err, closeAll(pool, cleanups))
			}
		}
		if err := consume("peer-orchestrator", orch, def.ReplyTopic()); err != nil {
			return nil, errors.Join(err, closeAll(pool, cleanups))
		}
	}
	runCtx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	errs := make(chan error, len(runs))
	for _, f := range runs {
		wg.Add(1)
		go func() { defer wg.Done(); errs <- f(runCtx) }()
	}
	stop := func() error {
		cancel()
		wg.Wait()
		close(errs)
		var all []error
		for err := range errs {
			if err != nil && !errors.Is(err, context.Canceled) {
				all = append(all, err)
			}
		}
		_ = closeAll(pool, cleanups)
		return errors.Join(all...)
	}
	opts := []saga.StartOption{saga.WithWriter(w)}
	if mode == onceflowLocal {
		opts = append(opts, saga.RunLocalSteps())
	}
	return &peerSystem{
		done:  done,
		pool:  pool,
		check: checkSagaEffects(pool),
		stop:  stop,
		start: func(ctx context.Context, n int) error {
			return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, peerOrderSQL, n, benchPayload); err != nil {
					return err
				}
				_, err := saga.StartTx(ctx, tx, def, sagaBenchData{N: n}, opts...)
				return err
			})
		},
	}, nil
}

func closeAll(pool *pgxpool.Pool, cleanups []func()) error {
	for i := len(cleanups) - 1; i >= 0; i-- {
		cleanups[i]()
	}
	pool.Close()
	return nil
}
