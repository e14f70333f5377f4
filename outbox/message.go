package outbox

import (
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
)

// Metadata keys onceflow reads and writes. They travel as Kafka headers like any other
// metadata, so a plain watermill-kafka subscriber sees them too.
const (
	// MetadataPartitionKey holds the partition key. The writer stores it in its own column and
	// the relay sends it as the Kafka message key; messages with the same key keep their order.
	MetadataPartitionKey = "partition_key"
	// MetadataSagaID, MetadataSagaStep and MetadataSagaPhase identify a saga message; the inbox
	// deduplicates on them instead of the event id when they are present.
	MetadataSagaID    = "saga_id"
	MetadataSagaStep  = "saga_step"
	MetadataSagaPhase = "saga_phase" // "action" or "compensation"
	// MetadataTraceParent and MetadataTraceState carry W3C trace context across the broker.
	MetadataTraceParent = "traceparent"
	MetadataTraceState  = "tracestate"
)

// NewUUID returns a new UUIDv7 string: time-ordered, so ids sort roughly by creation and index
// well. Use it as cqrs.JSONMarshaler's NewUUID so command and event buses mint v7 ids too.
func NewUUID() string { return uuid.Must(uuid.NewV7()).String() }

// NewMessage returns a Watermill message whose UUID is a fresh UUIDv7. The id is the event's
// identity for life: the relay publishes it as the Watermill UUID header and every retry,
// re-publish and replay reuses it.
func NewMessage(payload []byte) *message.Message {
	return message.NewMessage(NewUUID(), payload)
}

// SetPartitionKey sets the message's partition key and returns the message, for chaining.
// Messages with the same key are published in the order their transactions wrote them.
func SetPartitionKey(msg *message.Message, key string) *message.Message {
	msg.Metadata.Set(MetadataPartitionKey, key)
	return msg
}

// PartitionKey returns the message's partition key, or "" when it has none.
func PartitionKey(msg *message.Message) string { return msg.Metadata.Get(MetadataPartitionKey) }
