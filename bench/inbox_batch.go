package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/outbox"
)

// batchBenchConfig is the batched consumer's configuration in both batch rows: the defaults,
// with one worker per partition (the router's baseline also handles every partition at once),
// unless BENCH_BATCH_WORKERS or BENCH_BATCH_MAX set Workers or MaxBatch (for investigating a
// figure without editing the program).
func batchBenchConfig(e *env, topic string, p inbox.BatchProcessor) inboxkafka.BatchConfig {
	cfg := inboxkafka.BatchConfig{
		Brokers:   e.brokers,
		Group:     fmt.Sprintf("bench-batch-%d", time.Now().UnixNano()),
		Topics:    []string{topic},
		Processor: p,
		Workers:   inboxBenchPartitions,
		Logger:    e.log,
	}
	if n, err := strconv.Atoi(os.Getenv("BENCH_BATCH_WORKERS")); err == nil {
		cfg.Workers = n
	}
	if n, err := strconv.Atoi(os.Getenv("BENCH_BATCH_MAX")); err == nil {
		cfg.MaxBatch = n
	}
	return cfg
}

// effectNoPublish is the handler a router user has for the effect: one INSERT on the inbox's
// transaction. Both inbox rows and both batch rows run it.
func effectNoPublish(msg *message.Message) error {
	_, err := outbox.MustTx(msg.Context()).Exec(msg.Context(), effectHandlerSQL, msg.UUID, msg.Payload)
	return err
}

// effectSet is effectNoPublish as a set-based handler: one INSERT for the whole batch.
func effectSet(ctx context.Context, tx pgx.Tx, msgs []*message.Message) ([]*message.Message, error) {
	ids, payloads := make([]string, len(msgs)), make([][]byte, len(msgs))
	for i, m := range msgs {
		ids[i], payloads[i] = m.UUID, m.Payload
	}
	_, err := tx.Exec(ctx, `INSERT INTO effect (msg_uuid, payload) SELECT * FROM unnest($1::text[], $2::bytea[])`, ids, payloads)
	return nil, err
}

// observedProcessor wraps a BatchProcessor and calls committed with the batch's messages and
// the time ProcessBatch was called after each successful ProcessBatch, i.e. once their
// effects and dedup rows committed.
type observedProcessor struct {
	inbox.BatchProcessor
	started   func()
	committed func(msgs []*message.Message, started time.Time)
}

func (p *observedProcessor) ProcessBatch(ctx context.Context, msgs []*message.Message) error {
	t0 := time.Now()
	if p.started != nil {
		p.started()
	}
	err := p.BatchProcessor.ProcessBatch(ctx, msgs)
	if err == nil {
		p.committed(msgs, t0)
	}
	return err
}

// runBatchConsumer starts a BatchConsumer on cfg and returns a function that stops it.
func runBatchConsumer(ctx context.Context, e *env, cfg inboxkafka.BatchConfig) (stop func(), err error) {
	c, err := inboxkafka.NewBatchConsumer(cfg)
	if err != nil {
		return nil, err
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(rctx) }()
	return func() {
		cancel()
		if err := <-done; err != nil {
			e.log.Warn("batch bench consumer", "err", err)
		}
	}, nil
}

// benchInboxBatch: the inbox scenario's 20,000 pre-produced messages (8 partitions, handler
// one INSERT) consumed by inboxkafka.BatchConsumer through ib.BatchNoPublish — the router
// user's handler unchanged — beside the per-message inbox through the Watermill router and
// the bare per-message handler, measured in the same run on the same topic.
func benchInboxBatch(ctx context.Context, e *env) ([]result, error) {
	pool, schema, err := e.freshSchema(ctx, "inbox_batch")
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	topic, err := prepareInboxBench(ctx, e, pool, "inbox-batch")
	if err != nil {
		return nil, err
	}
	bareRate, inboxRate, err := measureInboxRouter(ctx, e, pool, schema, topic)
	if err != nil {
		return nil, err
	}
	ib, err := inbox.New(inbox.Config{Pool: pool, Schema: schema, Consumer: "bench-batch", Logger: e.log})
	if err != nil {
		return nil, err
	}
	stopProfile := maybeProfile("inbox_batch-onceflow")
	batchRate, err := consumeBatchBench(ctx, e, topic, ib.BatchNoPublish(effectNoPublish))
	stopProfile()
	if err != nil {
		return nil, fmt.Errorf("batched: %w", err)
	}
	if err := checkEffects(ctx, pool, inboxBenchMessages); err != nil {
		return nil, fmt.Errorf("batched: %w", err)
	}
	if err := checkDedup(ctx, pool, "bench-batch", inboxBenchMessages); err != nil {
		return nil, fmt.Errorf("batched: %w", err)
	}
	// For comparison, not a target: the same effect as a set-based handler (ib.BatchFunc), one
	// INSERT … SELECT FROM unnest per batch instead of one INSERT per message.
	if _, err := pool.Exec(ctx, `TRUNCATE effect`); err != nil {
		return nil, err
	}
	ibSet, err := inbox.New(inbox.Config{Pool: pool, Schema: schema, Consumer: "bench-batch-set", Logger: e.log})
	if err != nil {
		return nil, err
	}
	setRate, err := consumeBatchBench(ctx, e, topic, ibSet.BatchFunc("", effectSet))
	if err != nil {
		return nil, fmt.Errorf("batched, set-based: %w", err)
	}
	if err := checkEffects(ctx, pool, inboxBenchMessages); err != nil {
		return nil, fmt.Errorf("batched, set-based: %w", err)
	}
	if err := checkDedup(ctx, pool, "bench-batch-set", inboxBenchMessages); err != nil {
		return nil, fmt.Errorf("batched, set-based: %w", err)
	}
	vsInbox, vsBare := batchRate/inboxRate, batchRate/bareRate
	return []result{
		{Scenario: "inbox_batch", System: "bare-handler", Value: bareRate, Unit: "msg/s", HigherIsBetter: true, Versus: "baseline (per message, own tx)"},
		{Scenario: "inbox_batch", System: "inbox-router", Value: inboxRate, Unit: "msg/s", HigherIsBetter: true,
			Versus: fmt.Sprintf("%.2f× bare-handler", inboxRate/bareRate)},
		{Scenario: "inbox_batch", System: "onceflow", Value: batchRate, Unit: "msg/s", HigherIsBetter: true,
			Versus: fmt.Sprintf("%.2f× inbox-router, %.2f× bare-handler", vsInbox, vsBare),
			Target: fmt.Sprintf("≥ 5× inbox-router %s, ≥ 2× bare-handler %s", mark(vsInbox >= 5), mark(vsBare >= 2))},
		{Scenario: "inbox_batch", System: "onceflow-set", Value: setRate, Unit: "msg/s", HigherIsBetter: true,
			Versus: fmt.Sprintf("%.2f× inbox-router, %.2f× bare-handler", setRate/inboxRate, setRate/bareRate), Target: "(set-based handler, no target)"},
		{Scenario: "inbox_batch_ratio", System: "vs-inbox-router", Value: vsInbox, Unit: "×", Versus: "-"},
		{Scenario: "inbox_batch_ratio", System: "vs-bare-handler", Value: vsBare, Unit: "×", Versus: "-"},
	}, nil
}

func mark(ok bool) string {
	if ok {
		return "✓"
	}
	return "✗"
}

// consumeBatchBench runs a BatchConsumer with a fresh group until every message of topic was
// applied, and returns messages/s from the start of the first batch to the commit of the last
// (group join time left out, as consumeInboxBench does).
func consumeBatchBench(ctx context.Context, e *env, topic string, p inbox.BatchProcessor) (float64, error) {
	var done, batches atomic.Int64
	var first, last atomic.Int64 // unix nanos
	finished := make(chan struct{})
	var once sync.Once
	op := &observedProcessor{
		BatchProcessor: p,
		started:        func() { first.CompareAndSwap(0, time.Now().UnixNano()) },
		committed: func(msgs []*message.Message, _ time.Time) {
			last.Store(time.Now().UnixNano())
			batches.Add(1)
			if done.Add(int64(len(msgs))) >= inboxBenchMessages {
				once.Do(func() { close(finished) })
			}
		},
	}
	cfg := batchBenchConfig(e, topic, op)
	stop, err := runBatchConsumer(ctx, e, cfg)
	if err != nil {
		return 0, err
	}
	defer stop()
	select {
	case <-finished:
	case <-time.After(15 * time.Minute):
		return 0, fmt.Errorf("timed out after %d of %d messages", done.Load(), inboxBenchMessages)
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	took := time.Duration(last.Load() - first.Load())
	if took <= 0 {
		return 0, errors.New("no measurable duration")
	}
	fmt.Fprintf(os.Stderr, "  batched: %d messages in %d batches (mean %.1f), %s\n",
		done.Load(), batches.Load(), float64(done.Load())/float64(batches.Load()), took.Round(time.Millisecond))
	return float64(inboxBenchMessages-1) / took.Seconds(), nil
}

// inboxBatchLatency* shape the latency row: one producer, one message every 5 ms (200/s),
// 2,000 messages (10 s) per consumer, over the inbox scenario's 8 partitions.
const (
	inboxBatchLatencyMessages = 2000
	inboxBatchLatencyInterval = 5 * time.Millisecond
	benchSentHeader           = "bench_sent_unix_nano"
	benchWarmHeader           = "bench_warm_up"
)

// latencyConsumer starts a consumer of topic whose handler is effectNoPublish behind the
// inbox, calling committed for each message once its effect has committed, with the time its
// processing started (the inbox middleware, or ProcessBatch, was called); it returns a
// function that stops the consumer.
type latencyConsumer func(ctx context.Context, topic string, committed func(msg *message.Message, started time.Time)) (stop func(), err error)

// benchInboxBatchLatency: publish → effect committed at 200 msg/s from one producer, for the
// batched consumer and the per-message inbox through the Watermill router, in the same run
// and the same time window (see measureConsumerLatency).
//
// "Effect committed" is taken on the consumer's side, in the same process as the producer
// (one clock): the time at which the call that committed the message's transaction returned
// — the inbox middleware (it returns after COMMIT) for the router, ProcessBatch for the
// batched consumer. A clock_timestamp() written by the handler's INSERT would be earlier than
// the commit, and for a batch earlier by the rest of the batch: that would flatter the
// batched consumer. The send time is stamped into a header just before the record is
// produced (franz-go, no linger), so the figure includes Kafka's produce and fetch.
func benchInboxBatchLatency(ctx context.Context, e *env) ([]result, error) {
	pool, schema, err := e.freshSchema(ctx, "inbox_batch_latency")
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `CREATE TABLE effect (id bigserial PRIMARY KEY, msg_uuid text NOT NULL, payload bytea NOT NULL)`); err != nil {
		return nil, err
	}
	router := func(ctx context.Context, topic string, committed func(*message.Message, time.Time)) (func(), error) {
		ib, err := inbox.New(inbox.Config{Pool: pool, Schema: schema, Consumer: "lat-router", Logger: e.log})
		if err != nil {
			return nil, err
		}
		logger := watermill.NopLogger{}
		sub, err := kafka.NewSubscriber(inboxkafka.SubscriberConfig(e.brokers, fmt.Sprintf("bench-lat-router-%d", time.Now().UnixNano())), logger)
		if err != nil {
			return nil, err
		}
		r, err := message.NewRouter(message.RouterConfig{CloseTimeout: time.Minute}, logger)
		if err != nil {
			return nil, err
		}
		observe := func(next message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				started := time.Now()
				out, err := next(msg) // the inbox middleware returns after COMMIT
				if err == nil {
					committed(msg, started)
				}
				return out, err
			}
		}
		r.AddConsumerHandler("bench", topic, sub, effectNoPublish).AddMiddleware(observe, ib.Middleware)
		rctx, cancel := context.WithCancel(ctx)
		runErr := make(chan error, 1)
		go func() { runErr <- r.Run(rctx) }()
		return func() {
			cancel()
			if err := <-runErr; err != nil {
				e.log.Warn("latency bench router", "err", err)
			}
		}, nil
	}
	batched := func(ctx context.Context, topic string, committed func(*message.Message, time.Time)) (func(), error) {
		ib, err := inbox.New(inbox.Config{Pool: pool, Schema: schema, Consumer: "lat-batch", Logger: e.log})
		if err != nil {
			return nil, err
		}
		op := &observedProcessor{BatchProcessor: ib.BatchNoPublish(effectNoPublish), committed: func(msgs []*message.Message, started time.Time) {
			for _, m := range msgs {
				committed(m, started)
			}
		}}
		return runBatchConsumer(ctx, e, batchBenchConfig(e, topic, op))
	}
	systems := []latencySystem{{name: "inbox-router", consumer: "lat-router", start: router}, {name: "onceflow", consumer: "lat-batch", start: batched}}
	lats, err := measureConsumerLatency(ctx, e, systems)
	if err != nil {
		return nil, err
	}
	// Exactly once: the warm-up messages and the timed ones, each applied once per consumer
	// (the two topics' messages have different uuids).
	want := inboxBatchLatencyMessages + inboxBenchPartitions
	if err := checkEffects(ctx, pool, len(systems)*want); err != nil {
		return nil, err
	}
	var out []result
	p50s := map[string]time.Duration{}
	for i, s := range systems {
		if err := checkDedup(ctx, pool, s.consumer, want); err != nil {
			return nil, fmt.Errorf("%s: %w", s.name, err)
		}
		lat := lats[i]
		p50, p99 := percentile(lat, 50), percentile(lat, 99)
		p50s[s.name] = p50
		fmt.Fprintf(os.Stderr, "  inbox_batch_latency %-12s n=%d p50=%s p90=%s p99=%s max=%s\n", s.name, len(lat), p50, percentile(lat, 90), p99, slices.Max(lat))
		out = append(out,
			result{Scenario: "inbox_batch_latency_p50", System: s.name, Value: ms(p50), Unit: "ms"},
			result{Scenario: "inbox_batch_latency_p99", System: s.name, Value: ms(p99), Unit: "ms"})
	}
	ratio := float64(p50s["onceflow"]) / float64(p50s["inbox-router"])
	for i := range out {
		switch {
		case out[i].System == "inbox-router":
			out[i].Versus = "baseline"
		case out[i].Scenario == "inbox_batch_latency_p50":
			out[i].Versus = fmt.Sprintf("%.2f× inbox-router's", ratio)
			out[i].Target = "≤ 1.10× inbox-router " + mark(ratio <= 1.10)
		default:
			r := out[i].Value / out[i-2].Value // the router's p99 is two rows up
			out[i].Versus = fmt.Sprintf("%.2f× inbox-router's", r)
		}
	}
	return out, nil
}

// latencySystem is one consumer of the latency row.
type latencySystem struct {
	name, consumer string // row name, inbox consumer name
	start          latencyConsumer
}

// measureConsumerLatency gives each system a topic of inboxBenchPartitions partitions,
// starts its consumer and warms it up with one message per partition (group joined, every
// partition fetched, connections open). Then one producer sends inboxBatchLatencyMessages
// messages to each topic, one per topic every inboxBatchLatencyInterval, round-robin over the
// partitions, and it returns, per system, each message's time from send to effect committed.
//
// The systems run at the same time, on the same schedule, rather than one after the other: on
// a shared machine whose load changes from second to second, two 10-second windows apart
// measure the neighbours as much as the consumers. Which topic gets the tick's first message
// alternates, so neither is always second.
func measureConsumerLatency(ctx context.Context, e *env, systems []latencySystem) ([][]time.Duration, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...),
		kgo.RecordPartitioner(kgo.ManualPartitioner()),
		kgo.ProducerLinger(0)) // franz-go lingers 10 ms by default: send each record at once
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	type sysState struct {
		topic       string
		mu          sync.Mutex
		lat, queued []time.Duration // send → committed, send → processing started
		batches     map[time.Time]int
		warm, timed atomic.Int64
	}
	states := make([]*sysState, len(systems))
	for i, sys := range systems {
		st := &sysState{topic: benchTopic("inbox-batch-latency-" + sys.name), batches: map[time.Time]int{}}
		states[i] = st
		if err := createInboxBenchTopic(e.brokers, st.topic); err != nil {
			return nil, err
		}
		committed := func(msg *message.Message, started time.Time) {
			at := time.Now()
			if msg.Metadata.Get(benchWarmHeader) != "" {
				st.warm.Add(1)
				return
			}
			sent, err := strconv.ParseInt(msg.Metadata.Get(benchSentHeader), 10, 64)
			if err != nil {
				e.log.Warn("latency bench: message without a send time", "uuid", msg.UUID)
				return
			}
			st.mu.Lock()
			st.lat = append(st.lat, at.Sub(time.Unix(0, sent)))
			st.queued = append(st.queued, started.Sub(time.Unix(0, sent)))
			st.batches[started]++
			st.mu.Unlock()
			st.timed.Add(1)
		}
		stop, err := sys.start(ctx, st.topic, committed)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", sys.name, err)
		}
		defer stop()
	}
	record := func(topic string, i int32, warmUp bool) *kgo.Record {
		msg := outbox.NewMessage(benchPayload)
		h := []kgo.RecordHeader{{Key: kafka.UUIDHeaderKey, Value: []byte(msg.UUID)}}
		if warmUp {
			h = append(h, kgo.RecordHeader{Key: benchWarmHeader, Value: []byte("1")})
		}
		return &kgo.Record{Topic: topic, Partition: i % inboxBenchPartitions, Key: []byte(keyName(int(i))), Value: msg.Payload, Headers: h}
	}
	for i, st := range states {
		for p := range int32(inboxBenchPartitions) {
			if err := cl.ProduceSync(ctx, record(st.topic, p, true)).FirstErr(); err != nil {
				return nil, fmt.Errorf("%s: warm-up: %w", systems[i].name, err)
			}
		}
	}
	for i, st := range states {
		if err := waitCount(ctx, &st.warm, inboxBenchPartitions, time.Minute); err != nil {
			return nil, fmt.Errorf("%s: warm-up: %w", systems[i].name, err)
		}
	}
	var produceErr atomic.Value
	begin := time.Now().Add(20 * time.Millisecond)
	for i := range inboxBatchLatencyMessages {
		// Paced on a schedule, not a sleep after each send, so a slow send does not push back
		// the ones after it.
		time.Sleep(time.Until(begin.Add(time.Duration(i) * inboxBatchLatencyInterval)))
		for j := range states {
			st := states[(i+j)%len(states)]
			r := record(st.topic, int32(i), false)
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: benchSentHeader, Value: []byte(strconv.FormatInt(time.Now().UnixNano(), 10))})
			cl.Produce(ctx, r, func(_ *kgo.Record, err error) {
				if err != nil {
					produceErr.CompareAndSwap(nil, err)
				}
			})
		}
	}
	if err := cl.Flush(ctx); err != nil {
		return nil, err
	}
	if err, _ := produceErr.Load().(error); err != nil {
		return nil, fmt.Errorf("produce: %w", err)
	}
	out := make([][]time.Duration, len(states))
	for i, st := range states {
		if err := waitCount(ctx, &st.timed, inboxBatchLatencyMessages, time.Minute); err != nil {
			return nil, fmt.Errorf("%s: %w", systems[i].name, err)
		}
		st.mu.Lock()
		out[i] = slices.Clone(st.lat)
		// Where the time goes: before processing started (Kafka, the consumer's own queueing)
		// and in it (the transaction).
		fmt.Fprintf(os.Stderr, "  inbox_batch_latency %-12s send → processing started p50=%s p90=%s; %.2f messages per transaction\n",
			systems[i].name, percentile(st.queued, 50), percentile(st.queued, 90), float64(len(st.lat))/float64(len(st.batches)))
		st.mu.Unlock()
	}
	return out, nil
}

// waitCount waits until n reaches want, polling every millisecond.
func waitCount(ctx context.Context, n *atomic.Int64, want int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for n.Load() < int64(want) {
		if time.Now().After(deadline) {
			return fmt.Errorf("%d of %d messages after %s", n.Load(), want, timeout)
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		time.Sleep(time.Millisecond)
	}
	return nil
}
