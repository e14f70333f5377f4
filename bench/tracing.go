package main

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/tracing"
	"github.com/onceflow/onceflow/outbox"
)

// discard is a span exporter that drops everything: the SDK does all its work (sampling,
// recording, batching) and nothing leaves the process.
type discard struct{}

func (discard) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (discard) Shutdown(context.Context) error                             { return nil }

// tracingConfig is one way of running with or without OpenTelemetry.
type tracingConfig struct {
	name string
	// tp is the provider given to the relay or the inbox; nil means none, and no global one
	// is installed in the bench either.
	tp func() (trace.TracerProvider, func())
}

var tracingConfigs = []tracingConfig{
	{"none", func() (trace.TracerProvider, func()) { return nil, func() {} }},
	{"noop", func() (trace.TracerProvider, func()) { return noop.NewTracerProvider(), func() {} }},
	{"sdk", func() (trace.TracerProvider, func()) {
		tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()), sdktrace.WithBatcher(discard{}))
		return tp, func() { _ = tp.Shutdown(context.Background()) }
	}},
}

// tracedParent is the traceparent every bench message carries (as if written inside a traced
// request), so the relay builds its links and the inbox its parent from real headers.
const tracedParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

// benchTracing: the cost of the tracing instrumentation on the relay's drain (20,000 events,
// one `send` span per batch with a link per message) and on the inbox (20,000 messages, one
// `process` span each), with no provider (the default: nothing installed), a no-op provider
// and the SDK sampling everything into a discarding exporter. Runs alternate between the
// three, three times, and keep the best of each, so a noisy neighbour hurts them alike.
func benchTracing(ctx context.Context, e *env) ([]result, error) {
	best := map[string]float64{}
	for round := range 3 {
		for _, tc := range tracingConfigs {
			rate, err := drainTraced(ctx, e, tc, round)
			if err != nil {
				return nil, fmt.Errorf("drain %s: %w", tc.name, err)
			}
			best["drain_trace_"+tc.name] = max(best["drain_trace_"+tc.name], rate)
		}
	}
	if err := inboxTraced(ctx, e, best); err != nil {
		return nil, err
	}
	var out []result
	out = append(out, spanCosts()...)
	for _, kind := range []string{"drain", "inbox"} {
		base := best[kind+"_trace_none"]
		for _, tc := range tracingConfigs {
			v := best[kind+"_trace_"+tc.name]
			out = append(out, result{Scenario: kind + "_trace_" + tc.name, System: "onceflow", Value: v, Unit: "ev/s",
				HigherIsBetter: true, Target: fmt.Sprintf("%.2f× none", v/base)})
		}
	}
	return out, nil
}

func drainTraced(ctx context.Context, e *env, tc tracingConfig, round int) (float64, error) {
	const total, perTx, keys = 20000, 100, 50
	sys, err := newOnceflowSystem(ctx, e, "trace")
	if err != nil {
		return 0, err
	}
	defer sys.close()
	tp, shutdown := tc.tp()
	defer shutdown()
	sys.tp = tp
	topic := benchTopic(fmt.Sprintf("trace-%s-%d", tc.name, round))
	for n := 0; n < total; n += perTx {
		msgs := keyedMessages(n, perTx, keys)
		for _, m := range msgs {
			m.Metadata.Set(outbox.MetadataTraceParent, tracedParent)
		}
		if err := sys.write(ctx, topic, msgs); err != nil {
			return 0, err
		}
	}
	rcv, err := newReceiver(ctx, e.brokers, topic)
	if err != nil {
		return 0, err
	}
	defer rcv.stop()
	start := time.Now()
	stop, err := sys.start(ctx)
	if err != nil {
		return 0, err
	}
	err = rcv.waitFor(ctx, total, 10*time.Minute)
	took := time.Since(start)
	stop()
	if err != nil {
		return 0, err
	}
	fmt.Fprintf(os.Stderr, "  drain, tracing %-4s %d events in %s\n", tc.name, total, took.Round(time.Millisecond))
	return float64(total) / took.Seconds(), nil
}

func inboxTraced(ctx context.Context, e *env, best map[string]float64) error {
	pool, schema, err := e.freshSchema(ctx, "trace_inbox")
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `CREATE TABLE effect (id bigserial PRIMARY KEY, msg_uuid text NOT NULL, payload bytea NOT NULL)`); err != nil {
		return err
	}
	topic := fmt.Sprintf("bench-trace-inbox-%d", time.Now().UnixNano())
	inboxBenchMeta = map[string]string{outbox.MetadataTraceParent: tracedParent}
	defer func() { inboxBenchMeta = nil }()
	if err := produceInboxBench(e.brokers, topic); err != nil {
		return err
	}
	h := func(msg *message.Message) ([]*message.Message, error) {
		_, err := outbox.MustTx(msg.Context()).Exec(msg.Context(), `INSERT INTO effect (msg_uuid, payload) VALUES ($1, $2)`, msg.UUID, msg.Payload)
		return nil, err
	}
	for round := range 3 {
		for _, tc := range tracingConfigs {
			tp, shutdown := tc.tp()
			// A consumer name per run: each run processes every message afresh.
			ib, err := inbox.New(inbox.Config{Pool: pool, Schema: schema, Consumer: fmt.Sprintf("trace-%s-%d", tc.name, round),
				Logger: e.log, TracerProvider: tp})
			if err != nil {
				shutdown()
				return err
			}
			rate, err := consumeInboxBench(ctx, e, topic, "bench-trace-"+tc.name, ib.Middleware, h)
			shutdown()
			if err != nil {
				return fmt.Errorf("inbox %s: %w", tc.name, err)
			}
			fmt.Fprintf(os.Stderr, "  inbox, tracing %-4s %.0f msg/s\n", tc.name, rate)
			best["inbox_trace_"+tc.name] = max(best["inbox_trace_"+tc.name], rate)
			if _, err := pool.Exec(ctx, `TRUNCATE effect`); err != nil {
				return err
			}
		}
	}
	return nil
}

// spanCosts measures, with testing.Benchmark, the instrumentation's CPU cost per message
// alone, as the call sites run it: the writer's `create` span and injection, and the inbox's
// extraction and `process` span. It puts the end-to-end rows in proportion: a message costs
// the drain about 10 µs and the inbox about 250 µs.
func spanCosts() []result {
	md := map[string]string{"partition_key": "key-a", outbox.MetadataTraceParent: tracedParent}
	var out []result
	for _, tc := range tracingConfigs {
		tp, shutdown := tc.tp()
		tr := tracing.New(tp, nil)
		create := testing.Benchmark(func(b *testing.B) {
			b.ReportAllocs()
			ctx := context.Background()
			for range b.N {
				sctx, span := tr.Start(ctx, tracing.Producer, "create", "orders")
				if span.IsRecording() {
					span.SetAttributes(tracing.MessagingSystem.String(tracing.System), tracing.MessagingDestinationName.String("orders"))
				}
				_ = tr.Inject(sctx, md)
				span.End()
			}
		})
		process := testing.Benchmark(func(b *testing.B) {
			b.ReportAllocs()
			ctx := context.Background()
			for range b.N {
				if !tr.Enabled() {
					continue
				}
				_, span := tr.Start(tr.Extract(ctx, md), tracing.Consumer, "process", "orders")
				if span.IsRecording() {
					span.SetAttributes(tracing.MessagingSystem.String(tracing.System), tracing.MessagingDestinationName.String("orders"))
				}
				span.End()
			}
		})
		shutdown()
		for _, r := range []struct {
			name string
			res  testing.BenchmarkResult
		}{{"create", create}, {"process", process}} {
			out = append(out, result{Scenario: "span_" + r.name + "_" + tc.name, System: "onceflow", Value: float64(r.res.NsPerOp()), Unit: "ns/msg",
				Target: fmt.Sprintf("%d allocs/msg", r.res.AllocsPerOp())})
		}
	}
	return out
}
