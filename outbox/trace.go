package outbox

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/internal/tracing"
)

// parentOf is the context a message's `create` span starts in: the message's own context when
// it carries a span (a consumer that writes the messages of many handlers in one statement
// gives each the span of the message it answers), else ctx.
func parentOf(ctx context.Context, msg *message.Message) context.Context {
	if mctx := msg.Context(); trace.SpanContextFromContext(mctx).IsValid() {
		return mctx
	}
	return ctx
}

// traced records the `create <topic>` span of one message (PRODUCER, a child of ctx's span)
// and returns the metadata to store: md with the span's W3C traceparent/tracestate, which the
// relay sends verbatim as Kafka headers and the inbox makes the parent of its `process` span.
// The span ends at once: it marks the message's creation, whose fate (the transaction's
// commit) the writer does not see. Without a provider and without a span in ctx, md is
// returned untouched and nothing is allocated.
func (w *Writer) traced(ctx context.Context, topic string, msg *message.Message, md message.Metadata) map[string]string {
	ctx, span := w.tracer.Start(ctx, tracing.Producer, "create", topic)
	if span.IsRecording() {
		span.SetAttributes(
			tracing.MessagingSystem.String(tracing.System),
			tracing.MessagingOperationName.String("create"),
			tracing.MessagingOperationType.String("create"),
			tracing.MessagingDestinationName.String(topic),
			tracing.MessagingMessageID.String(msg.UUID),
		)
		if k := PartitionKey(msg); k != "" {
			span.SetAttributes(tracing.MessagingKafkaKey.String(k))
		}
	}
	out := w.tracer.Inject(ctx, md)
	span.End()
	return out
}
