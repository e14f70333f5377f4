package outbox

import (
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
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

// ToTopic addresses msg to topic, overriding the topic of the write call (WriteTx) or of the
// handler (a message an inbox handler returns), so one call can write events for several
// topics in one statement. It returns msg for chaining:
//
//	err := outbox.WriteTx(ctx, tx, "", // no default topic: every message names its own
//		outbox.ToTopic(outbox.NewMessage(invoice), "billing.invoiced"),
//		outbox.ToTopic(outbox.NewMessage(mail), "mail.requested"))
//
// The routing key (MetadataTopic) is not stored with the row: it does not travel to the broker.
func ToTopic(msg *message.Message, topic string) *message.Message {
	msg.Metadata.Set(MetadataTopic, topic)
	return msg
}

// TopicOf returns the topic set with ToTopic, or fallback when the message has none.
func TopicOf(msg *message.Message, fallback string) string {
	if t, ok := msg.Metadata[MetadataTopic]; ok {
		return t
	}
	return fallback
}
