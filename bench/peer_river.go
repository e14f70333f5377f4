package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// The effect_vs_river row: business transactions that each insert one row and enqueue one
// unit of work whose effect is one INSERT, applied exactly once — as a River job (InsertTx in
// the business transaction; a worker that applies the effect and completes the job in the
// effect's transaction with JobCompleteTx) and as an onceflow event (outbox.WriteTx in the
// business transaction; one relay; kfake; inboxkafka.BatchConsumer behind the inbox, whose
// dedup row commits with the effect). Same PostgreSQL server (fsync on), same payload, same
// pool size (32 connections), in the same run.
//
// Every system is measured by the same harness (runPeers, rounds alternating between the
// systems). Throughput: effectPeerUnits business transactions from effectPeerWriters writers
// in 4 rounds, while the consumer side runs; units ÷ the rounds' time, each round from its
// first write to its last effect committed; and the writers' own time. Latency: one writer at
// effectPeerRate per second, effectPeerLatency units in 4 rounds; from just before the business transaction's COMMIT to the return of the effect
// transaction's COMMIT (River: the worker's tx.Commit; onceflow: ProcessBatch, which returns
// after COMMIT). CPU: user + system time of the bench process (which also runs kfake for
// onceflow) over the throughput rounds, per 1,000 effects, and of the PostgreSQL server when it
// is local.
var effectPeerUnits = envInt("BENCH_EFFECT_UNITS", 20000)

const (
	effectPeerWriters = 8
	effectPeerRate    = 200
	effectPeerLatency = 2000
	effectPeerTopic   = "effect-peer"
)

const (
	effectPeerTablesSQL = `CREATE TABLE business (n bigint PRIMARY KEY, payload bytea NOT NULL);
CREATE TABLE peer_effect (id bigserial PRIMARY KEY, n bigint NOT NULL, payload bytea NOT NULL)`
	effectPeerBusinessSQL = `INSERT INTO business (n, payload) VALUES ($1, $2)`
	effectPeerEffectSQL   = `INSERT INTO peer_effect (n, payload) VALUES ($1, $2)`
	benchNHeader          = "bench_n"
)

func benchEffectVsRiver(ctx context.Context, e *env) ([]result, error) {
	setups := []struct {
		name, what string
		setup      func(context.Context, *env) (*peerSystem, error)
	}{
		{"river", "River, default client settings (MaxWorkers 100, as in River's docs)", func(ctx context.Context, e *env) (*peerSystem, error) {
			return setupRiver(ctx, e, river.QueueConfig{MaxWorkers: 100})
		}},
		{"river-tuned", fmt.Sprintf("River, MaxWorkers %d, FetchCooldown %s, FetchPollInterval %s", riverTuned.MaxWorkers, riverTuned.FetchCooldown, riverTuned.FetchPollInterval), func(ctx context.Context, e *env) (*peerSystem, error) {
			return setupRiver(ctx, e, riverTuned)
		}},
		{"onceflow", "outbox.WriteTx, one relay, kfake, inboxkafka.BatchConsumer (8 partitions, 8 workers)", setupEffectOnceflow},
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
	const rounds, latencyRounds = 4, 4
	plan := peerPlan{row: "effect_vs_river", writers: effectPeerWriters, rounds: rounds, perRound: effectPeerUnits / rounds,
		latencyRounds: latencyRounds, perLatency: effectPeerLatency / latencyRounds, rate: effectPeerRate}
	if err := runPeers(ctx, plan, systems); err != nil {
		return nil, err
	}
	perK := func(d time.Duration, s *peerSystem) float64 { return d.Seconds() / (float64(s.units) / 1000) }
	by := map[string]*peerSystem{}
	for _, s := range systems {
		by[s.name] = s
		fmt.Fprintf(os.Stderr, "  effect_vs_river %-11s %7.0f effects/s, written in %s, p50 %s p99 %s, CPU/1k: process %.2f s, server %.2f s, %.2f tx/effect, WAL %.2f KiB/effect  (%s)\n",
			s.name, s.rate(), s.written.Round(time.Millisecond), percentile(s.latency, 50).Round(10*time.Microsecond),
			percentile(s.latency, 99).Round(10*time.Microsecond), perK(s.cpuProcess, s), perK(s.cpuServer, s), s.commitsPerUnit, s.walPerUnit(), s.what)
	}
	of, rv := by["onceflow"], by["river"]
	var out []result
	for _, s := range systems {
		r := result{Scenario: "effect_vs_river", System: s.name, Value: s.rate(), Unit: "effects/s", HigherIsBetter: true}
		if rv != nil && s != rv {
			r.Versus = fmt.Sprintf("%.2f× river", s.rate()/rv.rate())
		}
		if of != nil && rv != nil && s == of {
			r.Target = "≥ 1.0× river " + mark(of.rate() >= rv.rate())
		}
		out = append(out, r)
	}
	for _, s := range systems {
		out = append(out, result{Scenario: "effect_vs_river_written_in", System: s.name, Value: s.written.Seconds(), Unit: "s", Versus: "-"})
	}
	for _, s := range systems {
		out = append(out, result{Scenario: "effect_vs_river_p50", System: s.name, Value: ms(percentile(s.latency, 50)), Unit: "ms", Versus: "-"})
	}
	for _, s := range systems {
		out = append(out, result{Scenario: "effect_vs_river_p99", System: s.name, Value: ms(percentile(s.latency, 99)), Unit: "ms", Versus: "-"})
	}
	for _, s := range systems {
		out = append(out, result{Scenario: "effect_vs_river_tx", System: s.name, Value: s.commitsPerUnit, Unit: "tx/effect", Versus: "-", Target: "read-only included"})
	}
	for _, s := range systems {
		out = append(out, result{Scenario: "effect_vs_river_wal", System: s.name, Value: s.walPerUnit(), Unit: "KiB/effect", Versus: "-"})
	}
	for _, s := range systems {
		out = append(out, result{Scenario: "effect_vs_river_cpu", System: s.name, Value: perK(s.cpuProcess, s), Unit: "cpu-s/1k", Versus: "-", Target: "bench process"})
	}
	for _, s := range systems {
		if s.meter != nil && s.meter.postmaster != 0 {
			out = append(out, result{Scenario: "effect_vs_river_cpu_server", System: s.name, Value: perK(s.cpuServer, s), Unit: "cpu-s/1k", Versus: "-", Target: "PostgreSQL"})
		}
	}
	return out, nil
}

// checkEffectPeer verifies that want business rows exist and each unit's effect was applied
// exactly once.
func checkEffectPeer(pool *pgxpool.Pool) func(ctx context.Context, want int) error {
	return func(ctx context.Context, want int) error {
		return pollUntil(ctx, 10*time.Second, func() error {
			var business, effects, distinct int
			if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM business), count(*), count(DISTINCT n) FROM peer_effect`).Scan(&business, &effects, &distinct); err != nil {
				return err
			}
			if business != want || effects != want || distinct != want {
				return fmt.Errorf("%d business rows, %d effects (%d distinct), want %d", business, effects, distinct, want)
			}
			return nil
		})
	}
}

// riverTuned is the tuned River client of the row, the best of the settings tried on this
// 2-core machine (MaxWorkers 8, 16, 32 and 100; FetchCooldown 1–10 ms): fewer workers than
// the pool's 32 connections, so the writers are not starved of connections, and a shorter
// fetch cooldown for latency. BENCH_RIVER_WORKERS, BENCH_RIVER_COOLDOWN and BENCH_RIVER_POLL
// override it, for investigating without editing the program.
var riverTuned = river.QueueConfig{
	MaxWorkers:        envInt("BENCH_RIVER_WORKERS", 16),
	FetchCooldown:     envDuration("BENCH_RIVER_COOLDOWN", 10*time.Millisecond),
	FetchPollInterval: envDuration("BENCH_RIVER_POLL", 100*time.Millisecond),
}

// peerEffectArgs is the River job: the unit's number and its payload.
type peerEffectArgs struct {
	N       int    `json:"n"`
	Payload []byte `json:"payload"`
}

func (peerEffectArgs) Kind() string { return "peer_effect" }

// peerEffectWorker applies the effect and completes the job in one transaction, as River's
// docs recommend for transactional work (JobCompleteTx): a crash before the COMMIT leaves the
// job running, to be rescued and worked again with no effect applied.
type peerEffectWorker struct {
	river.WorkerDefaults[peerEffectArgs]
	pool *pgxpool.Pool
	done *completions
}

func (w *peerEffectWorker) Work(ctx context.Context, job *river.Job[peerEffectArgs]) error {
	tx, err := w.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, effectPeerEffectSQL, job.Args.N, job.Args.Payload); err != nil {
		return err
	}
	if _, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	w.done.mark(job.Args.N)
	return nil
}

// setupRiver migrates River's tables (rivermigrate, all versions) into a database of its own,
// with the business tables beside them, and starts a client with queue on the default queue.
func setupRiver(ctx context.Context, e *env, queue river.QueueConfig) (*peerSystem, error) {
	pool, _, err := e.freshDatabase(ctx, "river")
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*peerSystem, error) { pool.Close(); return nil, err }
	if _, err := pool.Exec(ctx, effectPeerTablesSQL); err != nil {
		return fail(err)
	}
	driver := riverpgxv5.New(pool)
	migrator, err := rivermigrate.New(driver, &rivermigrate.Config{Logger: e.log})
	if err != nil {
		return fail(err)
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return fail(err)
	}
	done, enqueued := newCompletions(), newCompletions()
	workers := river.NewWorkers()
	river.AddWorker(workers, &peerEffectWorker{pool: pool, done: done})
	client, err := river.NewClient(driver, &river.Config{
		Queues:  map[string]river.QueueConfig{river.QueueDefault: queue},
		Workers: workers,
		Logger:  e.log,
	})
	if err != nil {
		return fail(err)
	}
	if err := client.Start(ctx); err != nil {
		return fail(err)
	}
	return &peerSystem{
		enqueued: enqueued,
		done:     done,
		pool:     pool,
		check:    checkEffectPeer(pool),
		meter:    newCPUMeter(ctx, pool),
		stop: func() error {
			sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			err := client.Stop(sctx)
			pool.Close()
			return err
		},
		start: func(ctx context.Context, n int) error {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback(ctx) }()
			if _, err := tx.Exec(ctx, effectPeerBusinessSQL, n, benchPayload); err != nil {
				return err
			}
			if _, err := client.InsertTx(ctx, tx, peerEffectArgs{N: n, Payload: benchPayload}, nil); err != nil {
				return err
			}
			enqueued.mark(n)
			return tx.Commit(ctx)
		},
	}, nil
}

// setupEffectOnceflow: a database of its own, an 8-partition topic on the bench's kfake, one relay
// with its defaults and the batched consumer as the inbox_batch row runs it (batchBenchConfig:
// defaults, one worker per partition) through ib.BatchNoPublish with a per-message handler.
func setupEffectOnceflow(ctx context.Context, e *env) (*peerSystem, error) {
	pool, schema, err := e.freshOnceflowDatabase(ctx, "effect_onceflow")
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*peerSystem, error) { pool.Close(); return nil, err }
	if _, err := pool.Exec(ctx, effectPeerTablesSQL); err != nil {
		return fail(err)
	}
	topic := benchTopic(effectPeerTopic)
	if err := createInboxBenchTopic(e.brokers, topic); err != nil {
		return fail(err)
	}
	w, err := outbox.NewWriter(outbox.Config{Schema: schema})
	if err != nil {
		return fail(err)
	}
	ib, err := inbox.New(inbox.Config{Pool: pool, Schema: schema, Consumer: "effect-peer", Logger: e.log})
	if err != nil {
		return fail(err)
	}
	done, enqueued := newCompletions(), newCompletions()
	handler := func(msg *message.Message) error {
		n, err := strconv.Atoi(msg.Metadata.Get(benchNHeader))
		if err != nil {
			return fmt.Errorf("message %s without %s: %w", msg.UUID, benchNHeader, err)
		}
		_, err = outbox.MustTx(msg.Context()).Exec(msg.Context(), effectPeerEffectSQL, n, msg.Payload)
		return err
	}
	op := &observedProcessor{BatchProcessor: ib.BatchNoPublish(handler), committed: func(msgs []*message.Message, _ time.Time) {
		for _, m := range msgs {
			if n, err := strconv.Atoi(m.Metadata.Get(benchNHeader)); err == nil {
				done.mark(n)
			}
		}
	}}
	stopConsumer, err := runBatchConsumer(ctx, e, batchBenchConfig(e, topic, op))
	if err != nil {
		return fail(err)
	}
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: e.brokers})
	if err != nil {
		stopConsumer()
		return fail(err)
	}
	r, err := relay.New(relay.Config{Pool: pool, Sink: sink, Schema: schema, Logger: e.log})
	if err != nil {
		stopConsumer()
		_ = sink.Close()
		return fail(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- r.Run(rctx) }()
	return &peerSystem{
		enqueued: enqueued,
		done:     done,
		pool:     pool,
		check:    checkEffectPeer(pool),
		meter:    newCPUMeter(ctx, pool),
		stop: func() error {
			cancel()
			err := <-relayDone
			stopConsumer()
			_ = sink.Close()
			pool.Close()
			if errors.Is(err, context.Canceled) {
				err = nil
			}
			return err
		},
		start: func(ctx context.Context, n int) error {
			return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, effectPeerBusinessSQL, n, benchPayload); err != nil {
					return err
				}
				msg := outbox.SetPartitionKey(outbox.NewMessage(benchPayload), keyName(n%200))
				msg.Metadata.Set(benchNHeader, strconv.Itoa(n))
				if err := w.WriteTx(ctx, tx, topic, msg); err != nil {
					return err
				}
				enqueued.mark(n)
				return nil
			})
		},
	}, nil
}
