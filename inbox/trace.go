package inbox

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/internal/tracing"
)

// The values of the onceflow.inbox.outcome span attribute.
const (
	outcomeProcessed = "processed"
	outcomeDuplicate = "duplicate"
	outcomeFailed    = "failed"
	outcomeNoKey     = "no_key"
	outcomeParked    = "parked"
)

// startProcess starts the `process <topic>` span (CONSUMER) of one message, around its
// transaction. Its parent is the message's creation context, the `create` span whose W3C
// traceparent came with the message's metadata (Kafka headers), so one trace runs from the
// producer's request through the relay to this handler and on to the messages it writes. A
// span already in the message's context (a tracing middleware's) becomes a link. The
// returned context carries the span; with no provider installed it is ctx itself.
func (ib *Inbox) startProcess(ctx context.Context, msg *message.Message) (context.Context, trace.Span) {
	if !ib.tr.Enabled() {
		return ctx, trace.SpanFromContext(context.Background())
	}
	var opts []trace.SpanStartOption
	local := trace.SpanContextFromContext(ctx)
	pctx := ib.tr.Extract(ctx, msg.Metadata)
	if remote := trace.SpanContextFromContext(pctx); local.IsValid() && !remote.Equal(local) {
		opts = append(opts, trace.WithLinks(trace.Link{SpanContext: local}))
	}
	topic := message.SubscribeTopicFromCtx(ctx)
	ctx, span := ib.tr.Start(pctx, tracing.Consumer, "process", topic, opts...)
	if !span.IsRecording() {
		return ctx, span
	}
	span.SetAttributes(
		tracing.MessagingSystem.String(tracing.System),
		tracing.MessagingOperationName.String("process"),
		tracing.MessagingOperationType.String("process"),
		tracing.MessagingMessageID.String(msg.UUID),
		tracing.MessagingConsumerGroup.String(ib.cfg.Consumer),
	)
	if topic != "" {
		span.SetAttributes(tracing.MessagingDestinationName.String(topic))
	}
	if ib.cfg.TraceAttributes != nil {
		span.SetAttributes(ib.cfg.TraceAttributes(msg)...)
	}
	return ctx, span
}

// endProcess records the outcome (processed, duplicate, failed or no_key, as in the
// inbox metrics) and ends the span.
func endProcess(span trace.Span, outcome string, err error) {
	if !span.IsRecording() {
		return
	}
	span.SetAttributes(tracing.InboxOutcome.String(outcome))
	if err != nil {
		span.SetAttributes(tracing.ErrorType.String(errorType(err)))
		tracing.Fail(span, err)
	}
	span.End()
}

func errorType(err error) string {
	if IsPoison(err) {
		return "poison"
	}
	return "failed"
}

// TraceAttributesFunc returns extra attributes of a message's `process` span, such as the
// broker's partition and offset (inbox/inboxkafka.TraceAttributes reads them from
// watermill-kafka's message context).
type TraceAttributesFunc func(msg *message.Message) []attribute.KeyValue
