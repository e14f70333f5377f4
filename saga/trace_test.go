package saga_test

import (
	"context"
	"strings"
	"testing"
	"time"

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

// A transition no message carries — here a step's reply timeout — is a span in the saga's
// trace too: its parent is the request that started the saga (stored with the saga row), and
// the command it re-sends is created under it. Before, timer-fired transitions started no span
// and their commands began a trace of their own.
func TestTimerTransitionsAreInTheSagasTrace(t *testing.T) {
	t.Parallel()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	w := newWorld(t, timeoutDef(t, 50*time.Millisecond), "reserve")
	o, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: w.db.Pool, Schema: w.db.Schema, TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	if err := saga.Register(o, w.def); err != nil {
		t.Fatal(err)
	}
	writer, err := outbox.NewWriter(outbox.Config{Schema: w.db.Schema, TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	ctx, request := tp.Tracer("test").Start(context.Background(), "POST /checkout")
	err = pgx.BeginFunc(ctx, w.db.Pool, func(tx pgx.Tx) error {
		_, err := saga.StartTx(ctx, tx, w.def, Checkout{Order: "o-timer", Amount: 7}, saga.WithID("o-timer"), saga.WithWriter(writer))
		return err
	})
	request.End()
	if err != nil {
		t.Fatal(err)
	}
	// Nobody answers cmd.reserve: the timeout fires and re-sends attempt 2.
	deadline := time.Now().Add(20 * time.Second)
	for w.attemptsSent("o-timer")["2"] == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the timeout never re-sent the command")
		}
		if _, err := o.FireDue(context.Background()); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	traceID := request.SpanContext().TraceID()
	var timerSpan sdktrace.ReadOnlySpan
	spans := exp.GetSpans().Snapshots()
	for _, s := range spans {
		if strings.HasPrefix(s.Name(), "saga timer") {
			timerSpan = s
		}
	}
	if timerSpan == nil {
		t.Fatalf("no saga timer span among %d spans", len(spans))
	}
	if timerSpan.SpanContext().TraceID() != traceID || timerSpan.Parent().SpanID() != request.SpanContext().SpanID() {
		t.Fatalf("timer span %q: trace %s parent %s, want the request's trace %s and span %s", timerSpan.Name(),
			timerSpan.SpanContext().TraceID(), timerSpan.Parent().SpanID(), traceID, request.SpanContext().SpanID())
	}
	var resent bool
	for _, s := range spans {
		if strings.HasPrefix(s.Name(), "create") && s.Parent().SpanID() == timerSpan.SpanContext().SpanID() {
			resent = true
		}
	}
	if !resent {
		t.Fatal("the re-sent command's create span is not a child of the timer span")
	}
}
