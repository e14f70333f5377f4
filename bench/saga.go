package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/embedded"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
	"github.com/onceflow/onceflow/saga"
)

// The saga scenario: a three-step saga end to end in one process — started in business
// transactions by concurrent writers, commands and replies through the outbox, one relay,
// kfake and watermill-kafka subscribers, three participants (each step's action is one INSERT
// in the participant's transaction) and one orchestrator, on the durable embedded PostgreSQL.
const (
	sagaBenchSagas      = 3000
	sagaBenchWriters    = 8
	sagaBenchPartitions = 8
	sagaLatencyRate     = 100 // sagas/s for the latency run
	sagaLatencySagas    = 500
	sagaSlowRate        = 10 // sagas/s for the low-load latency run
	sagaSlowSagas       = 60
)

type sagaBenchData struct {
	N int `json:"n"`
}

// durations is a saga.Metrics that records start→completed times.
type durations struct {
	saga.NopMetrics
	mu   sync.Mutex
	took []time.Duration
	done atomic.Int64
	// compensated counts the sagas that compensated: none is planned, so each is a step that
	// timed out or failed.
	compensated atomic.Int64
}

func (d *durations) Completed(_ string, took time.Duration) {
	d.mu.Lock()
	d.took = append(d.took, took)
	d.mu.Unlock()
	d.done.Add(1)
}

func (d *durations) Compensated(string, time.Duration) { d.compensated.Add(1); d.done.Add(1) }

// sagaFigures are one run's measurements.
type sagaFigures struct {
	rate             float64       // sagas/s, sagaBenchWriters writers
	p50, p99         time.Duration // start → completed at sagaLatencyRate
	slowP50, slowP99 time.Duration // at sagaSlowRate
	// compensated: sagas that compensated (none planned: a step timed out or failed).
	compensated int64
	// txPerSaga and msgPerSaga: the transactions a saga costs (its start, and one per command
	// and per reply applied, as the per-message path commits them: counted from the dedup
	// rows) and the messages the relay published for it (outbox rows written), per saga.
	txPerSaga, msgPerSaga float64
}

// sagaShape is the saga a run measures: its steps, which of them are local (run in the
// orchestrator's transaction), and how the consumers take their messages.
type sagaShape struct {
	batched bool
	steps   []string
	local   map[string]bool
	// hot: every reserve also updates one of five stock rows (hot rows), and each remote step
	// has a 30 s reply timeout; only the throughput run is measured.
	hot bool
}

// hotSKUs is how many stock rows the hot shape's reserves update.
const hotSKUs = 5

var threeRemote = []string{"reserve", "charge", "confirm"}

// benchSaga runs the scenario twice, same run: the consumers under a Watermill router
// (watermill-kafka, one message per transaction: the baseline) and on
// inboxkafka.BatchConsumer (many messages of a partition per transaction).
func benchSaga(ctx context.Context, e *env) ([]result, error) {
	per, err := runSagaBench(ctx, e, sagaShape{steps: threeRemote})
	if err != nil {
		return nil, fmt.Errorf("per-message: %w", err)
	}
	bat, err := runSagaBench(ctx, e, sagaShape{batched: true, steps: threeRemote})
	if err != nil {
		return nil, fmt.Errorf("batched: %w", err)
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	return []result{
		{Scenario: "saga", System: "per-message", Value: per.rate, Unit: "sagas/s", HigherIsBetter: true},
		{Scenario: "saga", System: "onceflow", Value: bat.rate, Unit: "sagas/s", HigherIsBetter: true, Target: "≥ 1000 (DTM: 531 on 4 vCPUs)"},
		{Scenario: "saga_p50", System: "per-message", Value: ms(per.p50), Unit: "ms"},
		{Scenario: "saga_p50", System: "onceflow", Value: ms(bat.p50), Unit: "ms", Target: fmt.Sprintf("at %d sagas/s", sagaLatencyRate)},
		{Scenario: "saga_p99", System: "per-message", Value: ms(per.p99), Unit: "ms"},
		{Scenario: "saga_p99", System: "onceflow", Value: ms(bat.p99), Unit: "ms", Target: fmt.Sprintf("≤ 20 ms at %d sagas/s", sagaLatencyRate)},
		{Scenario: "saga_slow_p50", System: "per-message", Value: ms(per.slowP50), Unit: "ms"},
		{Scenario: "saga_slow_p50", System: "onceflow", Value: ms(bat.slowP50), Unit: "ms", Target: fmt.Sprintf("at %d sagas/s: no worse than per-message", sagaSlowRate)},
	}, nil
}

// benchSagaLocal: the checkout shape with the orchestrator's own steps local — place (local) →
// reserve → charge → confirm (local) — against the same four steps all remote, same run,
// batched consumers. A local step is one INSERT in the orchestrator's transaction; the first
// runs in StartTx's transaction (saga.RunLocalSteps).
func benchSagaLocal(ctx context.Context, e *env) ([]result, error) {
	four := []string{"place", "reserve", "charge", "confirm"}
	remote, err := runSagaBench(ctx, e, sagaShape{batched: true, steps: four})
	if err != nil {
		return nil, fmt.Errorf("all remote: %w", err)
	}
	local, err := runSagaBench(ctx, e, sagaShape{batched: true, steps: four, local: map[string]bool{"place": true, "confirm": true}})
	if err != nil {
		return nil, fmt.Errorf("local: %w", err)
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	return []result{
		{Scenario: "saga_local", System: "all-remote", Value: remote.rate, Unit: "sagas/s", HigherIsBetter: true},
		{Scenario: "saga_local", System: "onceflow", Value: local.rate, Unit: "sagas/s", HigherIsBetter: true, Target: "≥ 1.5× all-remote"},
		{Scenario: "saga_local_p99", System: "all-remote", Value: ms(remote.p99), Unit: "ms"},
		{Scenario: "saga_local_p99", System: "onceflow", Value: ms(local.p99), Unit: "ms", Target: fmt.Sprintf("lower than all-remote, at %d sagas/s", sagaLatencyRate)},
		{Scenario: "saga_local_tx", System: "all-remote", Value: remote.txPerSaga, Unit: "tx/saga"},
		{Scenario: "saga_local_tx", System: "onceflow", Value: local.txPerSaga, Unit: "tx/saga", Target: "5 or 6 vs 9"},
		{Scenario: "saga_local_msgs", System: "all-remote", Value: remote.msgPerSaga, Unit: "msg/saga"},
		{Scenario: "saga_local_msgs", System: "onceflow", Value: local.msgPerSaga, Unit: "msg/saga", Target: "4 vs 8"},
	}, nil
}

// benchSagaHot: the saga row's three-step saga with every reserve also updating one of five
// stock rows (`UPDATE stock SET reserved = reserved + 1 WHERE sku = n % 5`): concurrent
// transactions — batches of different partitions, or single messages of different
// partitions — update the same rows in different orders, and PostgreSQL breaks their
// deadlocks. Batched vs per-message, same run, each remote step with a 30 s timeout; no saga
// is planned to compensate, so the compensated count is the steps that timed out or failed.
func benchSagaHot(ctx context.Context, e *env) ([]result, error) {
	per, err := runSagaBench(ctx, e, sagaShape{steps: threeRemote, hot: true})
	if err != nil {
		return nil, fmt.Errorf("per-message: %w", err)
	}
	bat, err := runSagaBench(ctx, e, sagaShape{batched: true, steps: threeRemote, hot: true})
	if err != nil {
		return nil, fmt.Errorf("batched: %w", err)
	}
	return []result{
		{Scenario: "saga_hot", System: "per-message", Value: per.rate, Unit: "sagas/s", HigherIsBetter: true},
		{Scenario: "saga_hot", System: "onceflow", Value: bat.rate, Unit: "sagas/s", HigherIsBetter: true, Target: "no timeouts (see saga_hot_compensated)"},
		{Scenario: "saga_hot_compensated", System: "per-message", Value: float64(per.compensated), Unit: "sagas"},
		{Scenario: "saga_hot_compensated", System: "onceflow", Value: float64(bat.compensated), Unit: "sagas", Target: "0 (none planned)"},
	}, nil
}

func runSagaBench(ctx context.Context, e *env, shape sagaShape) (sagaFigures, error) {
	var fig sagaFigures
	batched := shape.batched
	pool, schema, err := e.freshSchema(ctx, "saga")
	if err != nil {
		return fig, err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `CREATE TABLE effect (saga text NOT NULL, step text NOT NULL, PRIMARY KEY (saga, step));
		CREATE TABLE stock (sku int PRIMARY KEY, reserved int NOT NULL DEFAULT 0);
		INSERT INTO stock (sku) SELECT generate_series(0, `+fmt.Sprint(hotSKUs-1)+`)`); err != nil {
		return fig, err
	}
	// A cluster of its own with several partitions per topic, so each consumer group handles
	// several messages at once (watermill-kafka handles one at a time per partition).
	k, err := embedded.StartKafka(sagaBenchPartitions)
	if err != nil {
		return fig, err
	}
	defer k.Stop()
	brokers := k.Brokers()

	w, err := outbox.NewWriter(outbox.Config{Schema: schema})
	if err != nil {
		return fig, err
	}
	build := func(d sagaBenchData) (any, error) { return d, nil }
	var steps []*saga.StepDef[sagaBenchData]
	var remote []string // the steps that have a participant
	for _, s := range shape.steps {
		st := saga.Step[sagaBenchData](s)
		if shape.local[s] {
			step := s
			st.Local(func(ctx context.Context, tx pgx.Tx, d *sagaBenchData) error {
				_, err := tx.Exec(ctx, `INSERT INTO effect (saga, step) VALUES ($1, $2)`, fmt.Sprint(d.N), step)
				return err
			})
		} else {
			st.Send("bench."+s, build)
			remote = append(remote, s)
		}
		if s != "confirm" && !shape.local[s] {
			st.Compensate("bench.undo."+s, build)
		}
		if shape.hot && !shape.local[s] {
			st.Timeout(30 * time.Second) // docs/sagas.md's reserve step
		}
		steps = append(steps, st)
	}
	def, err := saga.Define("bench", 1, steps)
	if err != nil {
		return fig, err
	}
	metrics := &durations{}
	orch, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: pool, Schema: schema, Writer: w, Logger: e.log, Metrics: metrics})
	if err != nil {
		return fig, err
	}
	if err := saga.Register(orch, def); err != nil {
		return fig, err
	}
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: brokers})
	if err != nil {
		return fig, err
	}
	defer func() { _ = sink.Close() }()
	r, err := relay.New(relay.Config{Pool: pool, Sink: sink, Schema: schema, Logger: e.log})
	if err != nil {
		return fig, err
	}
	var runs []func(context.Context) error
	var subs []*kafka.Subscriber
	var running <-chan struct{}
	effect := func(step string) func(ctx context.Context, tx pgx.Tx, d sagaBenchData) (struct{}, error) {
		return func(ctx context.Context, tx pgx.Tx, d sagaBenchData) (struct{}, error) {
			if shape.hot && step == "reserve" {
				sku := ((d.N % hotSKUs) + hotSKUs) % hotSKUs
				if _, err := tx.Exec(ctx, `UPDATE stock SET reserved = reserved + 1 WHERE sku = $1`, sku); err != nil {
					return struct{}{}, err
				}
			}
			_, err := tx.Exec(ctx, `INSERT INTO effect (saga, step) VALUES ($1, $2)`, fmt.Sprint(d.N), step)
			return struct{}{}, err
		}
	}
	undo := func(context.Context, pgx.Tx, sagaBenchData) error { return nil }
	if batched {
		consume := func(group string, p inbox.BatchProcessor, topics ...string) error {
			c, err := inboxkafka.NewBatchConsumer(inboxkafka.BatchConfig{Brokers: brokers, Group: group, Topics: topics, Processor: p,
				Logger: e.log})
			if err == nil {
				runs = append(runs, c.Run)
			}
			return err
		}
		for _, s := range remote {
			p, err := saga.NewParticipant(saga.ParticipantConfig{Pool: pool, Schema: schema, Consumer: "bench-" + s, Writer: w, Logger: e.log})
			if err != nil {
				return fig, err
			}
			if err := consume("bench-"+s, saga.ActionProcessor(p, effect(s)), "bench."+s); err != nil {
				return fig, err
			}
			if shape.hot && s != "confirm" { // a step that timed out is compensated
				if err := consume("bench-undo-"+s, saga.CompensationProcessor(p, undo), "bench.undo."+s); err != nil {
					return fig, err
				}
			}
		}
		if err := consume("bench-orchestrator", orch, def.ReplyTopic()); err != nil {
			return fig, err
		}
		ready := make(chan struct{})
		close(ready) // the warm-up saga waits for the groups to join
		running = ready
	} else {
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
		if err != nil {
			return fig, err
		}
		subscriber := func(group string) (*kafka.Subscriber, error) {
			sub, err := kafka.NewSubscriber(inboxkafka.SubscriberConfig(brokers, group), watermill.NopLogger{})
			if err == nil {
				subs = append(subs, sub)
			}
			return sub, err
		}
		for _, s := range remote {
			p, err := saga.NewParticipant(saga.ParticipantConfig{Pool: pool, Schema: schema, Consumer: "bench-" + s, Writer: w, Logger: e.log})
			if err != nil {
				return fig, err
			}
			sub, err := subscriber("bench-" + s)
			if err != nil {
				return fig, err
			}
			router.AddConsumerHandler(s, "bench."+s, sub, saga.Action(p, effect(s)))
			if shape.hot && s != "confirm" { // a step that timed out is compensated
				usub, err := subscriber("bench-undo-" + s)
				if err != nil {
					return fig, err
				}
				router.AddConsumerHandler("undo-"+s, "bench.undo."+s, usub, saga.Compensation(p, undo))
			}
		}
		sub, err := subscriber("bench-orchestrator")
		if err != nil {
			return fig, err
		}
		router.AddConsumerHandler("orchestrator", def.ReplyTopic(), sub, orch.Handler)
		runs = append(runs, router.Run)
		running = router.Running()
	}

	runCtx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	runs = append(runs, r.Run, orch.Run)
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
			all = append(all, err)
		}
		for _, s := range subs {
			_ = s.Close()
		}
		return errors.Join(all...)
	}
	select {
	case <-running:
	case <-time.After(30 * time.Second):
		return fig, errors.Join(errors.New("router did not start"), stop())
	}
	start := func(n int) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := saga.StartTx(ctx, tx, def, sagaBenchData{N: n}, saga.WithWriter(w), saga.RunLocalSteps())
			return err
		})
	}
	wait := func(n int64, limit time.Duration) error {
		deadline := time.Now().Add(limit)
		for metrics.done.Load() < n {
			if time.Now().After(deadline) {
				return fmt.Errorf("%d of %d sagas finished in %s", metrics.done.Load(), n, limit)
			}
			time.Sleep(5 * time.Millisecond)
		}
		return nil
	}

	// Warm-up: the consumer groups join and the first records flow.
	if err := start(-1); err != nil {
		return fig, errors.Join(err, stop())
	}
	if err := wait(1, 60*time.Second); err != nil {
		return fig, errors.Join(err, stop())
	}

	// Throughput: sagaBenchSagas started by concurrent writers, until all completed.
	stopProfile := maybeProfile(map[bool]string{false: "saga-per-message", true: "saga-onceflow"}[batched])
	began := time.Now()
	var next atomic.Int64
	var wwg sync.WaitGroup
	werrs := make(chan error, sagaBenchWriters)
	for range sagaBenchWriters {
		wwg.Add(1)
		go func() {
			defer wwg.Done()
			for {
				n := int(next.Add(1))
				if n > sagaBenchSagas {
					return
				}
				if err := start(n); err != nil {
					werrs <- err
					return
				}
			}
		}()
	}
	wwg.Wait()
	fmt.Fprintf(os.Stderr, "  %s: %d sagas started in %s\n", map[bool]string{false: "per-message", true: "batched"}[batched], sagaBenchSagas, time.Since(began).Round(time.Millisecond))
	close(werrs)
	if err := <-werrs; err != nil {
		return fig, errors.Join(err, stop())
	}
	if err := wait(1+sagaBenchSagas, 5*time.Minute); err != nil {
		return fig, errors.Join(err, stop())
	}
	rate := float64(sagaBenchSagas) / time.Since(began).Seconds()
	stopProfile()

	// Latency: sagas started at a steady rate; start → completed, on the database clock (the
	// orchestrator measures it from the saga row's created_at).
	latency := func(rate, count, first int) (p50, p99 time.Duration, err error) {
		metrics.mu.Lock()
		metrics.took = nil
		metrics.mu.Unlock()
		base := metrics.done.Load()
		tick := time.NewTicker(time.Second / time.Duration(rate))
		for i := range count {
			<-tick.C
			if err := start(first + i); err != nil {
				tick.Stop()
				return 0, 0, err
			}
		}
		tick.Stop()
		if err := wait(base+int64(count), 2*time.Minute); err != nil {
			return 0, 0, err
		}
		metrics.mu.Lock()
		took := slices.Clone(metrics.took)
		metrics.mu.Unlock()
		slices.Sort(took)
		return took[len(took)/2], took[len(took)*99/100], nil
	}
	fig.rate = rate
	fig.compensated = metrics.compensated.Load()
	if shape.hot {
		return fig, stop()
	}
	if fig.p50, fig.p99, err = latency(sagaLatencyRate, sagaLatencySagas, 100000); err != nil {
		return fig, errors.Join(err, stop())
	}
	if fig.slowP50, fig.slowP99, err = latency(sagaSlowRate, sagaSlowSagas, 200000); err != nil {
		return fig, errors.Join(err, stop())
	}
	if err := stop(); err != nil && !errors.Is(err, context.Canceled) {
		return fig, err
	}
	var effects int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM effect`).Scan(&effects); err != nil {
		return fig, err
	}
	sagas := 1 + sagaBenchSagas + sagaLatencySagas + sagaSlowSagas
	if want := len(shape.steps) * sagas; effects != want {
		return fig, fmt.Errorf("saga bench: %d effects, want %d", effects, want)
	}
	// Commands and replies applied (their dedup rows; barrier rows are "saga-barrier:"), and
	// the outbox rows written (the identity's last value: the relay deleted them).
	var applied, written int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM processed_event WHERE dedup_key LIKE 'saga:%'`).Scan(&applied); err != nil {
		return fig, err
	}
	if err := pool.QueryRow(ctx, `SELECT coalesce(max(last_value), 0) FROM pg_sequences WHERE schemaname = $1 AND sequencename LIKE 'outbox%'`, schema).Scan(&written); err != nil {
		return fig, err
	}
	fig.txPerSaga = float64(int64(sagas)+applied) / float64(sagas)
	fig.msgPerSaga = float64(written) / float64(sagas)
	return fig, nil
}
