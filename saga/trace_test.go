package saga_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
	"github.com/onceflow/onceflow/saga/sagatest"
)

// A saga started inside a traced request stays in that request's trace: every command the
// orchestrator sends, every participant's `process` span, every reply and every transition
// (with the saga's state after it) share the request's trace id, chained through the
// traceparent each outbox row carries.
func TestSagaTransitionsAreSpansOfTheSagasTrace(t *testing.T) {
	t.Parallel()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	w := newWorld(t, checkoutDef(t, nil))
	o, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: w.db.Pool, Schema: w.db.Schema, TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	if err := saga.Register(o, w.def); err != nil {
		t.Fatal(err)
	}
	bus := sagatest.NewBus(w.db.Pool, w.db.Schema)
	bus.Orchestrate(o)
	for _, name := range stepNames {
		p, err := saga.NewParticipant(saga.ParticipantConfig{Pool: w.db.Pool, Schema: w.db.Schema, Consumer: "svc-" + name, TracerProvider: tp})
		if err != nil {
			t.Fatal(err)
		}
		bus.Subscribe("cmd."+name, saga.Action(p, w.action(name)))
		bus.Subscribe("undo."+name, saga.Compensation(p, w.compensation(name)))
	}
	writer, err := outbox.NewWriter(outbox.Config{Schema: w.db.Schema, TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	ctx, request := tp.Tracer("test").Start(context.Background(), "POST /checkout")
	err = pgx.BeginFunc(ctx, w.db.Pool, func(tx pgx.Tx) error {
		_, err := saga.StartTx(ctx, tx, w.def, Checkout{Order: "o-traced", Amount: 42}, saga.WithID("o-traced"), saga.WithWriter(writer))
		return err
	})
	request.End()
	if err != nil {
		t.Fatal(err)
	}
	w.bus = bus
	if d := w.runUntil("o-traced", saga.StateCompleted, saga.StateCompensated); d.State != saga.StateCompleted {
		t.Fatalf("state %s", d.State)
	}
	traceID := request.SpanContext().TraceID()
	var process, create int
	var states []string
	for _, s := range exp.GetSpans() {
		if s.SpanContext.TraceID() != traceID {
			t.Errorf("span %q is in trace %s, not the request's %s", s.Name, s.SpanContext.TraceID(), traceID)
		}
		switch {
		case len(s.Name) >= 7 && s.Name[:7] == "process":
			process++
			for _, a := range s.Attributes {
				if a.Key == "onceflow.saga.state" {
					states = append(states, a.Value.AsString())
				}
			}
		case len(s.Name) >= 6 && s.Name[:6] == "create":
			create++
		}
	}
	// 3 commands and 3 replies, each created once and processed once.
	if process != 6 || create != 6 {
		t.Errorf("%d process and %d create spans, want 6 and 6", process, create)
	}
	if len(states) != 3 || states[2] != string(saga.StateCompleted) {
		t.Errorf("transition states %v, want 3 ending with completed", states)
	}
}
