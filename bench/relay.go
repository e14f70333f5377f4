package main

// The relay scenarios: drain, latency and stall, each measured for the onceflow relay and for
// the plain-Watermill way of doing the same (watermill/components/forwarder over watermill-sql,
// publishing with watermill-kafka), on the same Postgres, the same Kafka, the same ~200 B
// payloads, and read back by the same franz-go consumer.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"runtime/pprof"
	rtrace "runtime/trace"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

const forwarderName = "forwarder"

// relaySystem is one way of moving committed events to Kafka.
type relaySystem interface {
	// write commits msgs to topic in one transaction.
	write(ctx context.Context, topic string, msgs []*message.Message) error
	// start begins publishing; stop ends it.
	start(ctx context.Context) (stop func(), err error)
	// pool is the database the system writes to.
	db() *pgxpool.Pool
	close()
}

// onceflowSystem: the outbox writer and the relay with its defaults (batch 1000, LISTEN/NOTIFY
// with a 1 s poll fallback, 64 shards), publishing through the Kafka sink.
type onceflowSystem struct {
	e      *env
	pool   *pgxpool.Pool
	schema string
	w      *outbox.Writer
	tp     trace.TracerProvider // the relay's TracerProvider (tracing.go); nil: none
}

func newOnceflowSystem(ctx context.Context, e *env, name string) (*onceflowSystem, error) {
	pool, schema, err := e.freshSchema(ctx, name+"_of")
	if err != nil {
		return nil, err
	}
	w, err := outbox.NewWriter(outbox.Config{Schema: schema})
	if err != nil {
		pool.Close()
		return nil, err
	}
	return &onceflowSystem{e: e, pool: pool, schema: schema, w: w}, nil
}

func (s *onceflowSystem) db() *pgxpool.Pool { return s.pool }
func (s *onceflowSystem) close()            { s.pool.Close() }

func (s *onceflowSystem) write(ctx context.Context, topic string, msgs []*message.Message) error {
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error { return s.w.WriteTx(ctx, tx, topic, msgs...) })
}

func (s *onceflowSystem) start(ctx context.Context) (func(), error) {
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: s.e.brokers})
	if err != nil {
		return nil, err
	}
	r, err := relay.New(relay.Config{Pool: s.pool, Sink: sink, Schema: s.schema, Logger: s.e.relayLog(), TracerProvider: s.tp})
	if err != nil {
		_ = sink.Close()
		return nil, err
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	return func() {
		cancel()
		if err := <-done; err != nil {
			s.e.log.Error("relay", "err", err)
		}
		_ = sink.Close()
	}, nil
}

// forwarderSystem: Watermill's forwarder. Writers publish through forwarder.NewPublisher over
// a watermill-sql v4 publisher bound to the transaction (sql.TxFromPgx); the forwarder reads
// with a watermill-sql subscriber (sql.BeginnerFromPgx, poll 10 ms, batch 1000) and publishes
// with watermill-kafka's publisher, partition key as Kafka key.
type forwarderSystem struct {
	e       *env
	pool    *pgxpool.Pool
	schema  wsql.DefaultPostgreSQLSchema
	fwTopic string
	sub     *wsql.Subscriber
}

func newForwarderSystem(ctx context.Context, e *env, name string) (*forwarderSystem, error) {
	pool, _, err := e.freshSchema(ctx, name+"_fw")
	if err != nil {
		return nil, err
	}
	s := &forwarderSystem{e: e, pool: pool, fwTopic: "forwarder_" + name, schema: wsql.DefaultPostgreSQLSchema{SubscribeBatchSize: 1000}}
	s.sub, err = wsql.NewSubscriber(wsql.BeginnerFromPgx(pool), wsql.SubscriberConfig{
		SchemaAdapter:    s.schema,
		OffsetsAdapter:   wsql.DefaultPostgreSQLOffsetsAdapter{},
		PollInterval:     10 * time.Millisecond,
		InitializeSchema: true,
	}, watermill.NopLogger{})
	if err != nil {
		pool.Close()
		return nil, err
	}
	if err := s.sub.SubscribeInitialize(s.fwTopic); err != nil {
		pool.Close()
		return nil, err
	}
	return s, nil
}

func (s *forwarderSystem) db() *pgxpool.Pool { return s.pool }
func (s *forwarderSystem) close()            { _ = s.sub.Close(); s.pool.Close() }

func (s *forwarderSystem) write(ctx context.Context, topic string, msgs []*message.Message) error {
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		pub, err := wsql.NewPublisher(wsql.TxFromPgx(tx), wsql.PublisherConfig{SchemaAdapter: s.schema}, watermill.NopLogger{})
		if err != nil {
			return err
		}
		return forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: s.fwTopic}).Publish(topic, msgs...)
	})
}

func (s *forwarderSystem) start(ctx context.Context) (func(), error) {
	kpub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers: s.e.brokers,
		Marshaler: kafka.NewWithPartitioningMarshaler(func(_ string, m *message.Message) (string, error) {
			return outbox.PartitionKey(m), nil
		}),
	}, watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	fw, err := forwarder.NewForwarder(s.sub, kpub, watermill.NopLogger{}, forwarder.Config{ForwarderTopic: s.fwTopic})
	if err != nil {
		_ = kpub.Close()
		return nil, err
	}
	done := make(chan error, 1)
	go func() { done <- fw.Run(ctx) }()
	select {
	case <-fw.Running():
	case err := <-done:
		return nil, fmt.Errorf("forwarder: %w", err)
	}
	return func() {
		if err := fw.Close(); err != nil {
			s.e.log.Error("forwarder close", "err", err)
		}
		if err := <-done; err != nil {
			s.e.log.Error("forwarder", "err", err)
		}
		_ = kpub.Close()
	}, nil
}

// receiver records when each event id arrives on a topic; the same franz-go consumer is used
// for every system.
type receiver struct {
	mu sync.Mutex
	// at holds each event's first arrival, keyed by the UUID's 16 bytes: a map without pointers,
	// which the GC does not scan, so the receiver's GC work does not grow with the drain it
	// measures (drain_growth's receiver holds a million events).
	at      map[uuid.UUID]time.Time
	changed chan struct{}
	cancel  context.CancelFunc
	done    chan struct{}
}

func newReceiver(ctx context.Context, brokers []string, topic string) (*receiver, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(100*time.Millisecond),
		kgo.MetadataMinAge(100*time.Millisecond), kgo.AllowAutoTopicCreation())
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	r := &receiver{at: map[uuid.UUID]time.Time{}, changed: make(chan struct{}, 1), cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		defer cl.Close()
		for ctx.Err() == nil {
			fs := cl.PollFetches(ctx)
			now := time.Now()
			r.mu.Lock()
			fs.EachRecord(func(rec *kgo.Record) {
				for _, h := range rec.Headers {
					if h.Key == relaykafka.UUIDHeader {
						id, err := uuid.ParseBytes(h.Value)
						if err != nil {
							continue // not an event of the run
						}
						if _, dup := r.at[id]; !dup {
							r.at[id] = now
						}
					}
				}
			})
			r.mu.Unlock()
			select {
			case r.changed <- struct{}{}:
			default:
			}
		}
	}()
	return r, nil
}

func (r *receiver) stop() { r.cancel(); <-r.done }

func (r *receiver) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.at)
}

func (r *receiver) when(id string) (time.Time, bool) {
	u, err := uuid.Parse(id)
	if err != nil {
		return time.Time{}, false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	t, ok := r.at[u]
	return t, ok
}

// waitFor waits until n distinct events arrived.
func (r *receiver) waitFor(ctx context.Context, n int, timeout time.Duration) error {
	deadline := time.After(timeout)
	for r.count() < n {
		select {
		case <-r.changed:
		case <-deadline:
			return fmt.Errorf("received %d of %d events within %s", r.count(), n, timeout)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

func benchTopic(name string) string {
	return fmt.Sprintf("bench-%s-%d", name, time.Now().UnixNano())
}

// keyedMessages builds n messages with the bench payload spread over keys.
func keyedMessages(start, n, keys int) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = outbox.SetPartitionKey(outbox.NewMessage(benchPayload), keyName((start+i)%keys))
	}
	return msgs
}

type systemFactory struct {
	name string
	make func(ctx context.Context, e *env, scenario string) (relaySystem, error)
}

var relaySystems = []systemFactory{
	{"onceflow", func(ctx context.Context, e *env, s string) (relaySystem, error) { return newOnceflowSystem(ctx, e, s) }},
	{forwarderName, func(ctx context.Context, e *env, s string) (relaySystem, error) { return newForwarderSystem(ctx, e, s) }},
}

// benchDrain: 20,000 events written 100 per transaction (50 keys) while nothing publishes;
// then the time from starting the publisher until the consumer has all of them.
func benchDrain(ctx context.Context, e *env) ([]result, error) {
	const total, perTx, keys = 20000, 100, 50
	var out []result
	for _, f := range relaySystems {
		sys, err := f.make(ctx, e, "drain")
		if err != nil {
			return nil, fmt.Errorf("%s: %w", f.name, err)
		}
		topic := benchTopic("drain-" + f.name)
		for n := 0; n < total; n += perTx {
			if err := sys.write(ctx, topic, keyedMessages(n, perTx, keys)); err != nil {
				sys.close()
				return nil, fmt.Errorf("%s: write: %w", f.name, err)
			}
		}
		rcv, err := newReceiver(ctx, e.brokers, topic)
		if err != nil {
			sys.close()
			return nil, err
		}
		stopProfile := maybeProfile("drain-" + f.name)
		start := time.Now()
		stop, err := sys.start(ctx)
		if err != nil {
			rcv.stop()
			sys.close()
			return nil, fmt.Errorf("%s: start: %w", f.name, err)
		}
		err = rcv.waitFor(ctx, total, 10*time.Minute)
		took := time.Since(start)
		stopProfile()
		stop()
		rcv.stop()
		sys.close()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", f.name, err)
		}
		rate := float64(total) / took.Seconds()
		fmt.Fprintf(os.Stderr, "  drain %-9s %d events in %s\n", f.name, total, took.Round(time.Millisecond))
		out = append(out, result{Scenario: "drain", System: f.name, Value: rate, Unit: "ev/s", HigherIsBetter: true, Target: targetIf(f.name, "≥ 10× forwarder")})
	}
	return out, nil
}

// benchLatency: one event per transaction at 200 events/s for 10 s from one writer, measured
// from just after the commit returned to the consumer's receipt; onceflow with its defaults
// (at this rate the relay stays awake and finds rows by polling every 2 ms).
func benchLatency(ctx context.Context, e *env) ([]result, error) {
	const rate, seconds, keys, writers = 200, 10, 50, 1
	total := rate * seconds
	var out []result
	for _, f := range relaySystems {
		sys, err := f.make(ctx, e, "latency")
		if err != nil {
			return nil, fmt.Errorf("%s: %w", f.name, err)
		}
		lat, err := measureLatency(ctx, e, sys, f.name, total, rate, keys, writers)
		sys.close()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", f.name, err)
		}
		p50, p99 := percentile(lat, 50), percentile(lat, 99)
		fmt.Fprintf(os.Stderr, "  latency %-9s n=%d p50=%s p99=%s max=%s\n", f.name, len(lat), p50, p99, slices.Max(lat))
		out = append(out,
			result{Scenario: "latency_p50", System: f.name, Value: ms(p50), Unit: "ms"},
			result{Scenario: "latency_p99", System: f.name, Value: ms(p99), Unit: "ms", Target: targetIf(f.name, "≤ 5 ms")})
	}
	return out, nil
}

func measureLatency(ctx context.Context, e *env, sys relaySystem, name string, total, rate, keys, writers int) ([]time.Duration, error) {
	topic := benchTopic("latency-" + name)
	rcv, err := newReceiver(ctx, e.brokers, topic)
	if err != nil {
		return nil, err
	}
	defer rcv.stop()
	stop, err := sys.start(ctx)
	if err != nil {
		return nil, err
	}
	defer stop()
	// Warm up: topic created, consumer assigned, connections open.
	if err := sys.write(ctx, topic, keyedMessages(0, 1, keys)); err != nil {
		return nil, err
	}
	if err := rcv.waitFor(ctx, 1, time.Minute); err != nil {
		return nil, fmt.Errorf("warm-up: %w", err)
	}
	// Events are scheduled every 1/rate; with several writers, they take the slots so a slow
	// commit does not push the whole schedule back.
	interval := time.Second / time.Duration(rate)
	start := time.Now().Add(50 * time.Millisecond)
	committed := make([]time.Time, total)
	ids := make([]string, total)
	var mu sync.Mutex
	next := 0
	var wg sync.WaitGroup
	errc := make(chan error, writers)
	for range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				mu.Lock()
				i := next
				next++
				mu.Unlock()
				if i >= total {
					return
				}
				time.Sleep(time.Until(start.Add(time.Duration(i) * interval)))
				msgs := keyedMessages(i, 1, keys)
				if err := sys.write(ctx, topic, msgs); err != nil {
					errc <- err
					return
				}
				committed[i], ids[i] = time.Now(), msgs[0].UUID
			}
		}()
	}
	wg.Wait()
	close(errc)
	if err := <-errc; err != nil {
		return nil, err
	}
	if err := rcv.waitFor(ctx, total+1, 2*time.Minute); err != nil {
		return nil, err
	}
	lat := make([]time.Duration, total)
	for i, id := range ids {
		at, _ := rcv.when(id)
		lat[i] = at.Sub(committed[i])
		// BENCH_LATDUMP=N prints each event slower than N ms with when it committed (into the
		// run), to tell a burst (a stall) from a spread tail; see BENCH_RELAY_DEBUG's batch log.
		if dump, err := strconv.ParseFloat(os.Getenv("BENCH_LATDUMP"), 64); err == nil && lat[i] > time.Duration(dump*float64(time.Millisecond)) {
			fmt.Fprintf(os.Stderr, "SLOW i=%d committed=%s +%.1fms lat=%s\n", i, committed[i].Format("15:04:05.000"), float64(committed[i].Sub(start))/1e6, lat[i])
		}
	}
	return lat, nil
}

// benchStall: an unrelated write transaction (a business table, not the outbox) is held open
// for 1 s; one event is committed meanwhile. Its delivery delay, commit to receipt, is the
// figure (the worst of 5 trials).
func benchStall(ctx context.Context, e *env) ([]result, error) {
	const trials = 5
	var out []result
	for _, f := range relaySystems {
		sys, err := f.make(ctx, e, "stall")
		if err != nil {
			return nil, fmt.Errorf("%s: %w", f.name, err)
		}
		delays, err := measureStall(ctx, e, sys, f.name, trials)
		sys.close()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", f.name, err)
		}
		worst := slices.Max(delays)
		fmt.Fprintf(os.Stderr, "  stall %-9s delays %v\n", f.name, delays)
		out = append(out, result{Scenario: "stall", System: f.name, Value: ms(worst), Unit: "ms", Target: targetIf(f.name, "≤ 10 ms")})
	}
	return out, nil
}

func measureStall(ctx context.Context, e *env, sys relaySystem, name string, trials int) ([]time.Duration, error) {
	if _, err := sys.db().Exec(ctx, `CREATE TABLE IF NOT EXISTS bench_unrelated (id bigserial PRIMARY KEY, note text)`); err != nil {
		return nil, err
	}
	topic := benchTopic("stall-" + name)
	rcv, err := newReceiver(ctx, e.brokers, topic)
	if err != nil {
		return nil, err
	}
	defer rcv.stop()
	stop, err := sys.start(ctx)
	if err != nil {
		return nil, err
	}
	defer stop()
	if err := sys.write(ctx, topic, keyedMessages(0, 1, 1)); err != nil {
		return nil, err
	}
	if err := rcv.waitFor(ctx, 1, time.Minute); err != nil {
		return nil, fmt.Errorf("warm-up: %w", err)
	}
	var delays []time.Duration
	for trial := range trials {
		foreign, err := sys.db().Begin(ctx)
		if err != nil {
			return nil, err
		}
		opened := time.Now()
		if _, err := foreign.Exec(ctx, `INSERT INTO bench_unrelated (note) VALUES ('held open')`); err != nil {
			_ = foreign.Rollback(ctx)
			return nil, err
		}
		msgs := keyedMessages(trial, 1, 1)
		if err := sys.write(ctx, topic, msgs); err != nil {
			_ = foreign.Rollback(ctx)
			return nil, err
		}
		committed := time.Now()
		time.Sleep(time.Until(opened.Add(time.Second))) // hold the foreign transaction 1 s
		if err := foreign.Commit(ctx); err != nil {
			return nil, err
		}
		if err := rcv.waitFor(ctx, trial+2, time.Minute); err != nil {
			return nil, err
		}
		at, ok := rcv.when(msgs[0].UUID)
		if !ok {
			return nil, errors.New("stall event not received")
		}
		delays = append(delays, at.Sub(committed))
	}
	return delays, nil
}

// maybeProfile writes a CPU profile of the bench process for the named phase when
// BENCH_CPUPROFILE names a folder (e.g. BENCH_CPUPROFILE=/tmp/prof make bench), to see where
// the time goes: go tool pprof -top /tmp/prof/drain-onceflow.pprof. A relative folder is taken
// from bench/, where `make bench` runs the program. It also writes the allocation profile at
// the phase's start and end, for what the phase allocated (the garbage collector's work):
// go tool pprof -sample_index=alloc_space -top -base NAME.allocs-start NAME.allocs.
func maybeProfile(name string) func() {
	dir := os.Getenv("BENCH_CPUPROFILE")
	if dir == "" {
		return func() {}
	}
	writeAllocs(filepath.Join(dir, name+".allocs-start"))
	f, err := os.Create(filepath.Join(dir, name+".pprof"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "cpu profile:", err)
		return func() {}
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		fmt.Fprintln(os.Stderr, "cpu profile:", err)
		_ = f.Close()
		return func() {}
	}
	return func() {
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "cpu profile:", err)
		}
		writeAllocs(filepath.Join(dir, name+".allocs"))
	}
}

func writeAllocs(path string) {
	f, err := os.Create(path)
	if err != nil {
		fmt.Fprintln(os.Stderr, "allocation profile:", err)
		return
	}
	defer func() { _ = f.Close() }()
	if err := pprof.Lookup("allocs").WriteTo(f, 0); err != nil {
		fmt.Fprintln(os.Stderr, "allocation profile:", err)
	}
}

// maybeTrace writes an execution trace of the bench process for the named phase when
// BENCH_TRACE names a folder: where goroutines waited (network, scheduler, syscalls), e.g.
// go tool trace -pprof=sched /tmp/trace/latency_load.trace > sched.pprof.
func maybeTrace(name string) func() {
	dir := os.Getenv("BENCH_TRACE")
	if dir == "" {
		return func() {}
	}
	f, err := os.Create(filepath.Join(dir, name+".trace"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "trace:", err)
		return func() {}
	}
	if err := rtrace.Start(f); err != nil {
		fmt.Fprintln(os.Stderr, "trace:", err)
		_ = f.Close()
		return func() {}
	}
	return func() {
		rtrace.Stop()
		if err := f.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "trace:", err)
		}
	}
}

func targetIf(system, target string) string {
	if system == "onceflow" {
		return target
	}
	return ""
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// percentile is the nearest-rank percentile of ds.
func percentile(ds []time.Duration, p float64) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	rank := int(math.Ceil(p/100*float64(len(s)))) - 1
	return s[max(0, min(rank, len(s)-1))]
}

// relayLog is the relay's logger: warnings only, or everything with BENCH_RELAY_DEBUG=1 (one
// line per batch with the time spent claiming, publishing and finishing).
func (e *env) relayLog() *slog.Logger {
	if os.Getenv("BENCH_RELAY_DEBUG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return e.log
}
