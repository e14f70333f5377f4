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
// Throughput: effectPeerUnits business transactions from effectPeerWriters writers while the
// consumer side runs; time from the first write to the last effect committed, and the
// writers' own time. Latency: one writer at effectPeerRate per second, effectPeerLatency
// units; from just before the business transaction's COMMIT to the return of the effect
// transaction's COMMIT (River: the worker's tx.Commit; onceflow: ProcessBatch, which returns
// after COMMIT). CPU: user + system time of the bench process (which also runs kfake for
// onceflow) over the throughput phase, per 1,000 effects, and of the PostgreSQL server when it
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

// effectPeer is one system of the row, ready to take business transactions.
type effectPeer struct {
	write    func(ctx context.Context, n int) error
	enqueued *completions // marked just before the business transaction's COMMIT
	done     *completions // marked when the effect's transaction has committed
	pool     *pgxpool.Pool
	stop     func() error
}

type effectPeerFigures struct {
	rate              float64 // effects/s
	writtenIn         time.Duration
	p50, p99          time.Duration
	cpuProc, cpuSrv   float64 // CPU seconds per 1,000 effects
	serverCPUObserved bool
}

func benchEffectVsRiver(ctx context.Context, e *env) ([]result, error) {
	systems := []struct {
		name, what string
		setup      func(context.Context, *env) (*effectPeer, error)
	}{
		{"river", "River, default client settings (MaxWorkers 100 as in River's docs)", func(ctx context.Context, e *env) (*effectPeer, error) {
			return setupRiver(ctx, e, river.QueueConfig{MaxWorkers: 100})
		}},
		{"river-tuned", fmt.Sprintf("River, MaxWorkers %d, FetchCooldown %s, FetchPollInterval %s", riverTuned.MaxWorkers, riverTuned.FetchCooldown, riverTuned.FetchPollInterval), func(ctx context.Context, e *env) (*effectPeer, error) {
			return setupRiver(ctx, e, riverTuned)
		}},
		{"onceflow", "outbox.WriteTx, one relay, kfake, inboxkafka.BatchConsumer (8 partitions, 8 workers)", setupEffectOnceflow},
	}
	figs := map[string]effectPeerFigures{}
	var order []string
	for _, s := range systems {
		if !peerSelected(s.name) {
			continue
		}
		p, err := s.setup(ctx, e)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", s.name, err)
		}
		fig, err := measureEffectPeer(ctx, s.name, p)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", s.name, err)
		}
		fmt.Fprintf(os.Stderr, "  effect_vs_river %-11s %7.0f effects/s, written in %s, p50 %s p99 %s, CPU/1k: process %.2f s, server %.2f s  (%s)\n",
			s.name, fig.rate, fig.writtenIn.Round(time.Millisecond), fig.p50.Round(10*time.Microsecond), fig.p99.Round(10*time.Microsecond), fig.cpuProc, fig.cpuSrv, s.what)
		figs[s.name] = fig
		order = append(order, s.name)
	}
	of, rv := figs["onceflow"], figs["river"]
	var out []result
	for _, name := range order {
		f := figs[name]
		r := result{Scenario: "effect_vs_river", System: name, Value: f.rate, Unit: "effects/s", HigherIsBetter: true}
		if name != "river" {
			r.Versus = fmt.Sprintf("%.2f× river", f.rate/rv.rate)
		}
		if name == "onceflow" {
			r.Target = "≥ 1.0× river " + mark(of.rate >= rv.rate)
		}
		out = append(out, r)
	}
	for _, name := range order {
		out = append(out, result{Scenario: "effect_vs_river_written_in", System: name, Value: figs[name].writtenIn.Seconds(), Unit: "s", Versus: "-"})
	}
	for _, name := range order {
		out = append(out, result{Scenario: "effect_vs_river_p50", System: name, Value: ms(figs[name].p50), Unit: "ms", Versus: "-"})
	}
	for _, name := range order {
		out = append(out, result{Scenario: "effect_vs_river_p99", System: name, Value: ms(figs[name].p99), Unit: "ms", Versus: "-"})
	}
	for _, name := range order {
		out = append(out, result{Scenario: "effect_vs_river_cpu", System: name, Value: figs[name].cpuProc, Unit: "cpu-s/1k", Versus: "-", Target: "bench process"})
	}
	for _, name := range order {
		if figs[name].serverCPUObserved {
			out = append(out, result{Scenario: "effect_vs_river_cpu_server", System: name, Value: figs[name].cpuSrv, Unit: "cpu-s/1k", Versus: "-", Target: "PostgreSQL"})
		}
	}
	return out, nil
}

// measureEffectPeer runs the harness on one system and checks, before stopping it, that every
// business row exists once and every effect was applied exactly once.
func measureEffectPeer(ctx context.Context, name string, p *effectPeer) (fig effectPeerFigures, err error) {
	defer p.pool.Close()
	stopped := false
	defer func() {
		if !stopped {
			err = errors.Join(err, p.stop())
		}
	}()
	if err := p.write(ctx, 0); err != nil { // warm-up
		return fig, fmt.Errorf("warm-up: %w", err)
	}
	if err := p.done.wait(ctx, 1, time.Minute); err != nil {
		return fig, fmt.Errorf("warm-up: %w", err)
	}
	meter := newCPUMeter(ctx, p.pool)
	stopProfile := maybeProfile("effect_vs_river-" + name)
	cpu0 := meter.sample()
	began := time.Now()
	writtenIn, err := runWriters(effectPeerWriters, 1, effectPeerUnits, func(n int) error { return p.write(ctx, n) })
	if err != nil {
		stopProfile()
		return fig, err
	}
	if err := p.done.wait(ctx, 1+effectPeerUnits, 5*time.Minute); err != nil {
		stopProfile()
		return fig, err
	}
	took := time.Since(began)
	cpu1 := meter.sample()
	stopProfile()
	fig.rate = float64(effectPeerUnits) / took.Seconds()
	fig.writtenIn = writtenIn
	fig.cpuProc = (cpu1.process - cpu0.process).Seconds() / (float64(effectPeerUnits) / 1000)
	fig.cpuSrv = (cpu1.server - cpu0.server).Seconds() / (float64(effectPeerUnits) / 1000)
	fig.serverCPUObserved = meter.postmaster != 0

	const first = 100000
	if _, err := paced(ctx, effectPeerRate, first, effectPeerLatency, func(n int) error { return p.write(ctx, n) }); err != nil {
		return fig, err
	}
	if err := p.done.wait(ctx, 1+effectPeerUnits+effectPeerLatency, time.Minute); err != nil {
		return fig, err
	}
	p.enqueued.mu.Lock()
	started := make(map[int]time.Time, effectPeerLatency)
	for n := first; n < first+effectPeerLatency; n++ {
		started[n] = p.enqueued.at[n]
	}
	p.enqueued.mu.Unlock()
	lat := p.done.latencies(started)
	fig.p50, fig.p99 = percentile(lat, 50), percentile(lat, 99)

	want := 1 + effectPeerUnits + effectPeerLatency
	var business, effects, distinct int
	if err := p.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM business), count(*), count(DISTINCT n) FROM peer_effect`).Scan(&business, &effects, &distinct); err != nil {
		return fig, err
	}
	if business != want || effects != want || distinct != want {
		return fig, fmt.Errorf("%d business rows, %d effects (%d distinct), want %d", business, effects, distinct, want)
	}
	stopped = true
	return fig, p.stop()
}

// riverTuned is the tuned River client of the row (BENCH_RIVER_WORKERS, BENCH_RIVER_COOLDOWN
// and BENCH_RIVER_POLL override it, for investigating without editing the program).
var riverTuned = river.QueueConfig{
	MaxWorkers:        envInt("BENCH_RIVER_WORKERS", 100),
	FetchCooldown:     envDuration("BENCH_RIVER_COOLDOWN", time.Millisecond),
	FetchPollInterval: envDuration("BENCH_RIVER_POLL", 50*time.Millisecond),
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
func setupRiver(ctx context.Context, e *env, queue river.QueueConfig) (*effectPeer, error) {
	pool, _, err := e.freshDatabase(ctx, "river")
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*effectPeer, error) { pool.Close(); return nil, err }
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
	return &effectPeer{
		enqueued: enqueued,
		done:     done,
		pool:     pool,
		stop: func() error {
			sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			return client.Stop(sctx)
		},
		write: func(ctx context.Context, n int) error {
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

// setupEffectOnceflow: a fresh schema, an 8-partition topic on the bench's kfake, one relay
// with its defaults and the batched consumer as the inbox_batch row runs it (batchBenchConfig:
// defaults, one worker per partition) through ib.BatchNoPublish with a per-message handler.
func setupEffectOnceflow(ctx context.Context, e *env) (*effectPeer, error) {
	pool, schema, err := e.freshSchema(ctx, "effect_peer")
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*effectPeer, error) { pool.Close(); return nil, err }
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
	return &effectPeer{
		enqueued: enqueued,
		done:     done,
		pool:     pool,
		stop: func() error {
			cancel()
			err := <-relayDone
			stopConsumer()
			_ = sink.Close()
			if errors.Is(err, context.Canceled) {
				err = nil
			}
			return err
		},
		write: func(ctx context.Context, n int) error {
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
