// Package tracing holds onceflow's OpenTelemetry instrumentation helpers, shared by the
// outbox writer, the relay, the inbox and the sagas, so that each call site is a line or two.
//
// Spans follow the OpenTelemetry messaging semantic conventions: `create <topic>` (PRODUCER,
// one per message written to the outbox), `send <topic>` (PRODUCER, one per batch the relay
// hands to its sink, linked to each message's creation context) and `process <topic>`
// (CONSUMER, the inbox transaction, whose parent is the message's creation context). The
// creation context travels in the message metadata as W3C traceparent/tracestate, stored in
// the outbox row and sent verbatim as Kafka headers.
//
// Only the OpenTelemetry API is used. With no provider given and none installed globally, a
// call costs a type check and no allocation; a message that already carries a span context
// (an upstream service's) still passes it on.
package tracing

import (
	"context"
	"reflect"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of every onceflow span.
const ScopeName = "github.com/onceflow/onceflow"

// System is the messaging.system of onceflow's spans: the relay's destination is Kafka.
const System = "kafka"

// Attribute keys of the messaging semantic conventions, and onceflow's own.
const (
	MessagingSystem          = attribute.Key("messaging.system")
	MessagingOperationName   = attribute.Key("messaging.operation.name")
	MessagingOperationType   = attribute.Key("messaging.operation.type")
	MessagingDestinationName = attribute.Key("messaging.destination.name")
	MessagingMessageID       = attribute.Key("messaging.message.id")
	MessagingKafkaKey        = attribute.Key("messaging.kafka.message.key")
	MessagingKafkaOffset     = attribute.Key("messaging.kafka.offset")
	MessagingPartitionID     = attribute.Key("messaging.destination.partition.id")
	MessagingConsumerGroup   = attribute.Key("messaging.consumer.group.name")
	MessagingBatchCount      = attribute.Key("messaging.batch.message_count")
	ErrorType                = attribute.Key("error.type")

	// OutboxID is the outbox row id (the relay's claim order) of a sent message.
	OutboxID = attribute.Key("onceflow.outbox.id")
	// InboxOutcome is what the inbox did: processed, duplicate or failed.
	InboxOutcome = attribute.Key("onceflow.inbox.outcome")
	// InboxDedupKey is the message's dedup key in processed_event.
	InboxDedupKey = attribute.Key("onceflow.inbox.dedup_key")
	// RelayAcked and RelayFailed count the messages of a send span the broker acknowledged
	// and did not.
	RelayAcked  = attribute.Key("onceflow.relay.acked")
	RelayFailed = attribute.Key("onceflow.relay.failed")
	// IdempotencyOutcome is the HTTP idempotency middleware's outcome (stored, replayed,
	// in_flight, mismatch, ...).
	IdempotencyOutcome = attribute.Key("onceflow.idempotency.outcome")
	// Saga attributes of a transition span.
	SagaID    = attribute.Key("onceflow.saga.id")
	SagaName  = attribute.Key("onceflow.saga.name")
	SagaStep  = attribute.Key("onceflow.saga.step")
	SagaEvent = attribute.Key("onceflow.saga.event")
	SagaState = attribute.Key("onceflow.saga.state")
)

// Tracer starts onceflow's spans with a provider and a propagator fixed at construction.
// The zero value is not usable; a nil *Tracer is (it behaves as New(nil, nil)).
type Tracer struct {
	tracer trace.Tracer
	// global: no provider was given, so the global one is used, and a span is started only
	// once one is installed (otel.SetTracerProvider).
	global bool
	prop   propagation.TextMapPropagator // nil: the global one, or W3C if none is installed
}

var nilTracer = New(nil, nil)

// New returns a Tracer using tp (nil: the global provider, otel.GetTracerProvider, followed
// even when it is installed later) and prop (nil: the global propagator, or W3C trace context
// when the global one is the default no-op).
func New(tp trace.TracerProvider, prop propagation.TextMapPropagator) *Tracer {
	t := &Tracer{prop: prop, global: tp == nil}
	if tp == nil {
		t.tracer = otel.Tracer(ScopeName)
	} else {
		t.tracer = tp.Tracer(ScopeName)
	}
	return t
}

func (t *Tracer) or() *Tracer {
	if t == nil {
		return nilTracer
	}
	return t
}

// globalPkg holds OpenTelemetry's default global provider, the delegating one in place until
// otel.SetTracerProvider is called. It is recognised by its package rather than captured at
// start-up, so a provider installed before this package's initialisation is not mistaken for
// it. Should OpenTelemetry move it, Enabled only turns true too often: spans then go to the
// delegating provider, which records nothing until one is installed.
const globalPkg = "go.opentelemetry.io/otel/internal/global"

// Enabled reports whether a span started now may record: a provider was given, or one is
// installed globally. When false, no span is started (see Start).
func (t *Tracer) Enabled() bool {
	if t = t.or(); !t.global {
		return true
	}
	typ := reflect.TypeOf(otel.GetTracerProvider())
	return typ.Kind() != reflect.Pointer || typ.Elem().PkgPath() != globalPkg
}

// Propagator returns the propagator in use: the one given, else the global one, else (when
// the global one is OpenTelemetry's default no-op) W3C trace context, so that the outbox
// always stores traceparent/tracestate when there is a span context to store.
func (t *Tracer) Propagator() propagation.TextMapPropagator {
	if t := t.or(); t.prop != nil {
		return t.prop
	}
	p := otel.GetTextMapPropagator()
	if len(p.Fields()) == 0 {
		return w3c
	}
	return p
}

var w3c = propagation.TraceContext{}

// Span-start options built once, so that starting a span allocates no option slice.
var (
	producer = []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindProducer)}
	consumer = []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer)}
	internal = []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindInternal)}
)

// Kind is a span kind Start accepts.
type Kind int

// The span kinds onceflow starts.
const (
	Producer Kind = iota
	Consumer
	Internal
)

// Start starts a span named op + " " + destination (just op when destination is "") of the
// given kind, child of ctx's span. When the tracer is not Enabled it starts nothing and
// returns ctx unchanged and a shared non-recording span, allocating nothing; ctx still
// carries any upstream span context, which Inject then passes on. Callers set attributes
// only when span.IsRecording(), so the disabled path builds none.
func (t *Tracer) Start(ctx context.Context, kind Kind, op, destination string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	t = t.or()
	if !t.Enabled() {
		return ctx, noSpan
	}
	name := op
	if destination != "" {
		name = op + " " + destination
	}
	base := internal
	switch kind {
	case Producer:
		base = producer
	case Consumer:
		base = consumer
	}
	if len(opts) > 0 {
		opts = append(append(make([]trace.SpanStartOption, 0, len(base)+len(opts)), base...), opts...)
	} else {
		opts = base
	}
	return t.tracer.Start(ctx, name, opts...)
}

// noSpan is what Start returns when it starts nothing: a non-recording span with no span
// context, shared, so the disabled path allocates nothing and never ends a span of the caller.
var noSpan = trace.SpanFromContext(context.Background())

// Inject writes the span context of ctx (as Start returned it) into a copy of md, under the
// propagator's fields, and returns the copy; md is never modified. Entries of md under those
// fields are replaced (or removed when ctx has no value for them). When ctx carries no valid
// span context, md is returned as it is: a message that already carries an upstream
// traceparent keeps it.
func (t *Tracer) Inject(ctx context.Context, md map[string]string) map[string]string {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return md
	}
	p := t.Propagator()
	out := make(map[string]string, len(md)+2)
	for k, v := range md {
		out[k] = v
	}
	for _, f := range p.Fields() {
		delete(out, f)
	}
	p.Inject(ctx, propagation.MapCarrier(out))
	return out
}

// Extract returns ctx carrying the remote span context stored in md (nil-safe), if any.
func (t *Tracer) Extract(ctx context.Context, md map[string]string) context.Context {
	if len(md) == 0 {
		return ctx
	}
	return t.Propagator().Extract(ctx, propagation.MapCarrier(md))
}

// Link returns a link to the span context stored in md; ok is false when md holds none.
func (t *Tracer) Link(md map[string]string, attrs ...attribute.KeyValue) (l trace.Link, ok bool) {
	sc := trace.SpanContextFromContext(t.Extract(context.Background(), md))
	if !sc.IsValid() {
		return trace.Link{}, false
	}
	return trace.Link{SpanContext: sc, Attributes: attrs}, true
}

// Fail marks span as failed with err (nothing when err is nil or span does not record).
func Fail(span trace.Span, err error) {
	if err == nil || !span.IsRecording() {
		return
	}
	span.RecordError(err)
	span.SetStatus(codes.Error, err.Error())
}
