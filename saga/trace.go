package saga

import (
	"context"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/internal/tracing"
	"github.com/onceflow/onceflow/outbox"
)

// startMessage starts the `process <topic>` span (CONSUMER) of a saga message — a reply at
// the orchestrator, a command at a participant — whose parent is the message's creation
// context from its metadata. The saga's messages thus chain into one trace: the request that
// started the saga, each command, its reply, the transition it caused and the next command.
// Timer-fired transitions have their span from startTimer.
func startMessage(tr *tracing.Tracer, msg *message.Message, ref outbox.SagaRef, consumer string) (context.Context, trace.Span) {
	ctx := msg.Context()
	if !tr.Enabled() {
		return ctx, trace.SpanFromContext(context.Background())
	}
	topic := message.SubscribeTopicFromCtx(ctx)
	ctx, span := tr.Start(tr.Extract(ctx, msg.Metadata), tracing.Consumer, "process", topic)
	if !span.IsRecording() {
		return ctx, span
	}
	span.SetAttributes(
		tracing.MessagingSystem.String(tracing.System),
		tracing.MessagingOperationName.String("process"),
		tracing.MessagingOperationType.String("process"),
		tracing.MessagingMessageID.String(msg.UUID),
		tracing.MessagingConsumerGroup.String(consumer),
		tracing.SagaID.String(ref.ID),
		tracing.SagaName.String(msg.Metadata.Get(outbox.MetadataSagaName)),
		tracing.SagaStep.String(ref.Step),
		tracing.SagaEvent.String(string(ref.Phase)+" "+msg.Metadata.Get(outbox.MetadataSagaOutcome)),
	)
	if topic != "" {
		span.SetAttributes(tracing.MessagingDestinationName.String(topic))
	}
	return ctx, span
}

// endMessage marks the span failed on err and ends it.
func endMessage(span trace.Span, err error) {
	if !span.IsRecording() {
		return
	}
	tracing.Fail(span, err)
	span.End()
}

// noteTransition records on ctx's span what a transition did: the saga's state after it, or
// why the event changed nothing.
func noteTransition(ctx context.Context, in *instance, fx *effects) {
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return
	}
	span.SetAttributes(tracing.SagaState.String(string(in.State)))
	for _, r := range fx.ran {
		span.AddEvent("saga local step " + r.Step + ": " + string(r.Phase) + " " + r.Outcome)
	}
	if fx.stale != "" {
		span.AddEvent("saga event ignored: " + fx.stale)
	}
}

// startTimer starts the span of a transition no message carries — a timer that fired: a
// step's timeout or re-send, the saga's deadline, an operator's retry or compensate — in the
// saga's trace: its parent is the span context StartTx's caller was in, stored with the saga
// (saga.trace), so the commands the transition sends continue that trace too.
func startTimer(ctx context.Context, tr *tracing.Tracer, in *instance, t timer) (context.Context, trace.Span) {
	if !tr.Enabled() {
		return ctx, trace.SpanFromContext(context.Background())
	}
	ctx, span := tr.Start(tr.Extract(ctx, in.Trace), tracing.Internal, "saga timer", t.Action)
	if span.IsRecording() {
		span.SetAttributes(
			tracing.SagaID.String(in.ID),
			tracing.SagaName.String(in.Name),
			tracing.SagaEvent.String(t.Kind+" "+t.Action),
		)
		if t.Kind == "step" {
			span.SetAttributes(tracing.SagaStep.String(strconv.Itoa(t.Step)))
		}
	}
	return ctx, span
}
