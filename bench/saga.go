package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

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
}

func (d *durations) Completed(_ string, took time.Duration) {
	d.mu.Lock()
	d.took = append(d.took, took)
	d.mu.Unlock()
	d.done.Add(1)
}

func (d *durations) Compensated(string, time.Duration) { d.done.Add(1) }

func benchSaga(ctx context.Context, e *env) ([]result, error) {
	pool, schema, err := e.freshSchema(ctx, "saga")
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `CREATE TABLE effect (saga text NOT NULL, step text NOT NULL, PRIMARY KEY (saga, step))`); err != nil {
		return nil, err
	}
	// A cluster of its own with several partitions per topic, so each consumer group handles
	// several messages at once (watermill-kafka handles one at a time per partition).
	k, err := embedded.StartKafka(sagaBenchPartitions)
	if err != nil {
		return nil, err
	}
	defer k.Stop()
	brokers := k.Brokers()

	w, err := outbox.NewWriter(outbox.Config{Schema: schema})
	if err != nil {
		return nil, err
	}
	build := func(d sagaBenchData) (any, error) { return d, nil }
	var steps []*saga.StepDef[sagaBenchData]
	for _, s := range []string{"reserve", "charge", "confirm"} {
		st := saga.Step[sagaBenchData](s).Send("bench."+s, build)
		if s != "confirm" {
			st.Compensate("bench.undo."+s, build)
		}
		steps = append(steps, st)
	}
	def, err := saga.Define("bench", 1, steps)
	if err != nil {
		return nil, err
	}
	metrics := &durations{}
	orch, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: pool, Schema: schema, Writer: w, Logger: e.log, Metrics: metrics})
	if err != nil {
		return nil, err
	}
	if err := saga.Register(orch, def); err != nil {
		return nil, err
	}
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: brokers})
	if err != nil {
		return nil, err
	}
	defer func() { _ = sink.Close() }()
	r, err := relay.New(relay.Config{Pool: pool, Sink: sink, Schema: schema, Logger: e.log})
	if err != nil {
		return nil, err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	var subs []*kafka.Subscriber
	subscriber := func(group string) (*kafka.Subscriber, error) {
		sub, err := kafka.NewSubscriber(inboxkafka.SubscriberConfig(brokers, group), watermill.NopLogger{})
		if err == nil {
			subs = append(subs, sub)
		}
		return sub, err
	}
	for _, s := range def.Steps() {
		p, err := saga.NewParticipant(saga.ParticipantConfig{Pool: pool, Schema: schema, Consumer: "bench-" + s, Writer: w, Logger: e.log})
		if err != nil {
			return nil, err
		}
		sub, err := subscriber("bench-" + s)
		if err != nil {
			return nil, err
		}
		step := s
		router.AddConsumerHandler(s, "bench."+s, sub, saga.Action(p, func(ctx context.Context, tx pgx.Tx, d sagaBenchData) (struct{}, error) {
			_, err := tx.Exec(ctx, `INSERT INTO effect (saga, step) VALUES ($1, $2)`, fmt.Sprint(d.N), step)
			return struct{}{}, err
		}))
	}
	sub, err := subscriber("bench-orchestrator")
	if err != nil {
		return nil, err
	}
	router.AddConsumerHandler("orchestrator", def.ReplyTopic(), sub, orch.Handler)

	runCtx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	errs := make(chan error, 3)
	for _, f := range []func(context.Context) error{r.Run, orch.Run, router.Run} {
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
	case <-router.Running():
	case <-time.After(30 * time.Second):
		return nil, errors.Join(errors.New("router did not start"), stop())
	}
	start := func(n int) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := saga.StartTx(ctx, tx, def, sagaBenchData{N: n}, saga.WithWriter(w))
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
		return nil, errors.Join(err, stop())
	}
	if err := wait(1, 60*time.Second); err != nil {
		return nil, errors.Join(err, stop())
	}

	// Throughput: sagaBenchSagas started by concurrent writers, until all completed.
	stopProfile := maybeProfile("saga-onceflow")
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
	close(werrs)
	if err := <-werrs; err != nil {
		return nil, errors.Join(err, stop())
	}
	if err := wait(1+sagaBenchSagas, 5*time.Minute); err != nil {
		return nil, errors.Join(err, stop())
	}
	rate := float64(sagaBenchSagas) / time.Since(began).Seconds()
	stopProfile()

	// Latency: sagas started at a steady sagaLatencyRate; start → completed, on the database
	// clock (the orchestrator measures it from the saga row's created_at).
	metrics.mu.Lock()
	metrics.took = nil
	metrics.mu.Unlock()
	base := metrics.done.Load()
	tick := time.NewTicker(time.Second / sagaLatencyRate)
	for i := range sagaLatencySagas {
		<-tick.C
		if err := start(100000 + i); err != nil {
			tick.Stop()
			return nil, errors.Join(err, stop())
		}
	}
	tick.Stop()
	if err := wait(base+sagaLatencySagas, 2*time.Minute); err != nil {
		return nil, errors.Join(err, stop())
	}
	metrics.mu.Lock()
	took := slices.Clone(metrics.took)
	metrics.mu.Unlock()
	slices.Sort(took)
	p50, p99 := took[len(took)/2], took[len(took)*99/100]
	if err := stop(); err != nil && !errors.Is(err, context.Canceled) {
		return nil, err
	}
	var effects int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM effect`).Scan(&effects); err != nil {
		return nil, err
	}
	if want := 3 * (1 + sagaBenchSagas + sagaLatencySagas); effects != want {
		return nil, fmt.Errorf("saga bench: %d effects, want %d", effects, want)
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	return []result{
		{Scenario: "saga", System: "onceflow", Value: rate, Unit: "sagas/s", HigherIsBetter: true, Target: "≥ 1000 (DTM: 531 on 4 vCPUs)"},
		{Scenario: "saga_p50", System: "onceflow", Value: ms(p50), Unit: "ms", Target: fmt.Sprintf("at %d sagas/s", sagaLatencyRate)},
		{Scenario: "saga_p99", System: "onceflow", Value: ms(p99), Unit: "ms", Target: "≤ 30 ms"},
	}, nil
}
