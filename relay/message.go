package relay

import (
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Message is one claimed outbox row on its way to the broker.
type Message struct {
	// ID is the row's outbox id: the claim order.
	ID int64
	// EventID is the message UUID minted when the row was written; it never changes.
	EventID string
	// Topic is the destination topic.
	Topic string
	// Key is the partition key; "" means none.
	Key string
	// Payload is the message body, byte for byte as written.
	Payload []byte
	// Metadata is every Watermill metadata entry of the message, the partition key included.
	Metadata message.Metadata
	// CreatedAt is when the row was written (database clock).
	CreatedAt time.Time
	// Attempts counts earlier undeliverable failures (IsUndeliverable) of this row.
	Attempts int

	keyHash int64
	// blockKey identifies the order chain the row belongs to: its key, or its own id when it
	// has none (rows without a key have no order to keep).
	blockKey string
	// badMetadata is set when the stored metadata could not be decoded; the row is refused
	// without reaching the sink.
	badMetadata error
}

// Watermill returns the row as a Watermill message: UUID = event id, same payload and
// metadata. Use it in a Sink for a generic message.Publisher.
func (m *Message) Watermill() *message.Message {
	wm := message.NewMessage(m.EventID, m.Payload)
	for k, v := range m.Metadata {
		wm.Metadata.Set(k, v)
	}
	return wm
}
