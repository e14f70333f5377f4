package tracing

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

const upstream = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

// With no provider installed (these tests never install a global one), starting a span and
// injecting allocate nothing, and metadata is returned as it is.
func TestDisabledPathAllocatesNothing(t *testing.T) {
	tr := New(nil, nil)
	if tr.Enabled() {
		t.Fatal("Enabled without a provider")
	}
	md := map[string]string{"k": "v"}
	ctx := context.Background()
	allocs := testing.AllocsPerRun(100, func() {
		sctx, span := tr.Start(ctx, Producer, "create", "orders")
		if span.IsRecording() {
			t.Fatal("recording")
		}
		_ = tr.Inject(sctx, md)
		span.End()
	})
	if allocs != 0 {
		t.Errorf("disabled path allocates %.0f times per call, want 0", allocs)
	}
}

// An upstream span context (a request traced by a service with no provider of its own) is
// still passed on, and an upstream traceparent already in the metadata is kept.
func TestDisabledPathPassesUpstreamContextOn(t *testing.T) {
	tr := New(nil, nil)
	ctx := tr.Extract(context.Background(), map[string]string{"traceparent": upstream})
	sctx, span := tr.Start(ctx, Producer, "create", "orders")
	defer span.End()
	md := map[string]string{"k": "v"}
	out := tr.Inject(sctx, md)
	if out["traceparent"] != upstream || out["k"] != "v" {
		t.Errorf("Inject = %v, want the upstream traceparent and k", out)
	}
	if _, ok := md["traceparent"]; ok {
		t.Error("Inject modified its argument")
	}
	kept := map[string]string{"traceparent": upstream}
	if got := tr.Inject(context.Background(), kept); got["traceparent"] != upstream {
		t.Errorf("Inject without a span context = %v, want the metadata untouched", got)
	}
}

// With a provider, a span is a child of ctx's span, its context replaces a stale one in
// the metadata, and Link finds it again.
func TestStartInjectLink(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	tr := New(tp, propagation.TraceContext{})
	if !tr.Enabled() {
		t.Fatal("not Enabled with a provider")
	}
	pctx, parent := tp.Tracer("t").Start(context.Background(), "parent")
	sctx, span := tr.Start(pctx, Producer, "create", "orders")
	out := tr.Inject(sctx, map[string]string{"traceparent": upstream, "tracestate": "stale=1"})
	span.End()
	parent.End()
	if _, ok := out["tracestate"]; ok {
		t.Errorf("a stale tracestate survived: %v", out)
	}
	l, ok := tr.Link(out)
	if !ok || l.SpanContext.SpanID() != span.SpanContext().SpanID() || l.SpanContext.TraceID() != parent.SpanContext().TraceID() {
		t.Errorf("Link = %v, %v; want the create span of the parent's trace", l, ok)
	}
	got := exp.GetSpans()
	if len(got) != 2 || got[0].Name != "create orders" || got[0].SpanKind != trace.SpanKindProducer || got[0].Parent.SpanID() != parent.SpanContext().SpanID() {
		t.Errorf("spans %+v", got)
	}
	if _, ok := tr.Link(map[string]string{"k": "v"}); ok {
		t.Error("Link found a context in metadata without one")
	}
}
