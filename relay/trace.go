package relay

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/internal/tracing"
)

// startSend starts the `send <topic>` span of one sink call (PRODUCER; just `send` when the
// batch has several topics), linked to the creation context (the `create` span) that each
// message's outbox row stores in its traceparent metadata. The relay does not change that
// metadata: the sink sends it verbatim as headers, so the consumer's `process` span is a
// child of `create`, not of this span. Nothing is built when no provider is installed.
func (r *Relay) startSend(ctx context.Context, msgs []*Message) (context.Context, trace.Span) {
	if !r.tr.Enabled() {
		return ctx, trace.SpanFromContext(context.Background())
	}
	topic := msgs[0].Topic
	for _, m := range msgs {
		if m.Topic != topic {
			topic = ""
			break
		}
	}
	ctx, span := r.tr.Start(ctx, tracing.Producer, "send", topic)
	if !span.IsRecording() { // a no-op provider, or not sampled: build nothing
		return ctx, span
	}
	// Links are added after the start (not with trace.WithLinks) so a provider that records
	// nothing costs no decoding of every row's traceparent; samplers do not see them.
	for _, m := range msgs {
		if l, ok := r.tr.Link(m.Metadata, tracing.MessagingMessageID.String(m.EventID)); ok {
			span.AddLink(l)
		}
	}
	span.SetAttributes(
		tracing.MessagingSystem.String(tracing.System),
		tracing.MessagingOperationName.String("send"),
		tracing.MessagingOperationType.String("send"),
	)
	if topic != "" {
		span.SetAttributes(tracing.MessagingDestinationName.String(topic))
	}
	if len(msgs) > 1 {
		span.SetAttributes(tracing.MessagingBatchCount.Int(len(msgs)))
	} else {
		m := msgs[0]
		span.SetAttributes(tracing.MessagingMessageID.String(m.EventID), tracing.OutboxID.Int64(m.ID))
		if m.Key != "" {
			span.SetAttributes(tracing.MessagingKafkaKey.String(m.Key))
		}
	}
	return ctx, span
}

// endSend records how many messages of the call the broker acknowledged, marks the span
// failed when any was not (error.type: undeliverable, transient or held_back), and ends it.
func (r *Relay) endSend(span trace.Span, errs []error) {
	if !span.IsRecording() {
		return
	}
	acked := 0
	var first error
	errType := ""
	for _, err := range errs {
		switch {
		case err == nil:
			acked++
			continue
		case errors.Is(err, ErrHeldBack):
			if errType == "" {
				errType = "held_back"
			}
		case IsUndeliverable(err):
			errType = string(FailureUndeliverable)
		default:
			if errType != string(FailureUndeliverable) {
				errType = string(FailureTransient)
			}
		}
		if first == nil || errors.Is(first, ErrHeldBack) {
			first = err
		}
	}
	span.SetAttributes(tracing.RelayAcked.Int(acked), tracing.RelayFailed.Int(len(errs)-acked))
	if first != nil {
		span.SetAttributes(tracing.ErrorType.String(errType))
		tracing.Fail(span, first)
	}
	span.End()
}
