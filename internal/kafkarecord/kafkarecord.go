// Package kafkarecord is the one mapping between a Watermill message and a Kafka record, shared
// by the relay's Kafka sink (writing) and the batched consumer (reading). It is the mapping
// watermill-kafka's DefaultMarshaler uses, so a plain watermill-kafka subscriber reads what
// the relay writes, and the batched consumer reads what any watermill-kafka publisher writes:
//
//   - the event id (message UUID) in the UUIDHeader header;
//   - every metadata entry as a header (sorted by key, so the same message always encodes the
//     same way);
//   - the payload as the value (an empty payload is an empty value, never null);
//   - the partition key as the record key (no key when empty).
package kafkarecord

import (
	"context"
	"errors"

	"slices"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/routerctx"
)

// UUIDHeader is the Kafka header carrying the event id: watermill-kafka's
// kafka.UUIDHeaderKey.
const UUIDHeader = "_watermill_message_uuid"

// ErrReservedHeader is returned for metadata that uses UUIDHeader as a key.
var ErrReservedHeader = errors.New("metadata key " + UUIDHeader + " is reserved for the event id")

// Encode returns the record of a message for topic.
func Encode(topic, key, eventID string, metadata map[string]string, payload []byte) (*kgo.Record, error) {
	if _, ok := metadata[UUIDHeader]; ok {
		return nil, ErrReservedHeader
	}
	rec := &kgo.Record{Topic: topic, Value: payload}
	if rec.Value == nil {
		rec.Value = []byte{} // an empty payload, not a null value
	}
	if key != "" {
		rec.Key = []byte(key)
	}
	rec.Headers = make([]kgo.RecordHeader, 0, len(metadata)+1)
	rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: UUIDHeader, Value: []byte(eventID)})
	keys := make([]string, 0, len(metadata))
	for k := range metadata {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: k, Value: []byte(metadata[k])})
	}
	return rec, nil
}

// Decode returns the Watermill message of a record. Its context is derived from ctx and
// carries the record's topic, as a Watermill router's does for the messages it hands a
// handler: message.SubscribeTopicFromCtx returns it, so a router handler reused in a batch
// (inbox.Inbox.Batch) and the `process <topic>` span see where the message came from.
func Decode(ctx context.Context, r *kgo.Record) *message.Message {
	md := make(message.Metadata, len(r.Headers))
	var id string
	for _, h := range r.Headers {
		if h.Key == UUIDHeader {
			id = string(h.Value)
			continue
		}
		md[h.Key] = string(h.Value)
	}
	msg := message.NewMessage(id, r.Value)
	msg.Metadata = md
	msg.SetContext(routerctx.With(ctx, routerctx.Values{SubscribeTopic: r.Topic}))
	return msg
}
