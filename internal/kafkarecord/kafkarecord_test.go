package kafkarecord_test

import (
	"context"
	"errors"
	"maps"
	"testing"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/internal/kafkarecord"
)

type ctxKey struct{}

// A message encoded for the relay and decoded by the batched consumer comes back whole, and
// agrees with watermill-kafka's DefaultMarshaler both ways.
func TestRoundTrip(t *testing.T) {
	md := map[string]string{"partition_key": "order-7", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "z": "", "a": "1"}
	rec, err := kafkarecord.Encode("orders.placed", "order-7", "0192d0a0-0000-7000-8000-000000000001", md, []byte(`{"id":7}`))
	if err != nil {
		t.Fatal(err)
	}
	if string(rec.Key) != "order-7" || rec.Topic != "orders.placed" || rec.Headers[0].Key != kafkarecord.UUIDHeader {
		t.Fatalf("record %+v", rec)
	}
	for i := 2; i < len(rec.Headers); i++ {
		if rec.Headers[i-1].Key > rec.Headers[i].Key {
			t.Fatalf("headers not sorted: %+v", rec.Headers)
		}
	}
	ctx := context.WithValue(context.Background(), ctxKey{}, "kept")
	msg := kafkarecord.Decode(ctx, rec)
	if msg.UUID != "0192d0a0-0000-7000-8000-000000000001" || string(msg.Payload) != `{"id":7}` || !maps.Equal(map[string]string(msg.Metadata), md) {
		t.Fatalf("decoded %s %s %v", msg.UUID, msg.Payload, msg.Metadata)
	}
	if got := message.SubscribeTopicFromCtx(msg.Context()); got != "orders.placed" {
		t.Fatalf("SubscribeTopicFromCtx = %q, want the record's topic", got)
	}
	if msg.Context().Value(ctxKey{}) != "kept" {
		t.Fatal("the parent context's values are lost")
	}
	if message.HandlerNameFromCtx(msg.Context()) != "" {
		t.Fatal("another router key answered with the topic")
	}

	// watermill-kafka reads the record as the same message (through sarama's record type).
	sm := &sarama.ConsumerMessage{Topic: rec.Topic, Key: rec.Key, Value: rec.Value}
	for _, h := range rec.Headers {
		sm.Headers = append(sm.Headers, &sarama.RecordHeader{Key: []byte(h.Key), Value: h.Value})
	}
	wm, err := kafka.DefaultMarshaler{}.Unmarshal(sm)
	if err != nil {
		t.Fatal(err)
	}
	if wm.UUID != msg.UUID || string(wm.Payload) != string(msg.Payload) || !maps.Equal(wm.Metadata, msg.Metadata) {
		t.Fatalf("watermill-kafka read %s %s %v", wm.UUID, wm.Payload, wm.Metadata)
	}
	// And what watermill-kafka writes, Decode reads.
	out := message.NewMessage("0192d0a0-0000-7000-8000-000000000002", []byte("p"))
	out.Metadata.Set("k", "v")
	pm, err := kafka.DefaultMarshaler{}.Marshal("t", out)
	if err != nil {
		t.Fatal(err)
	}
	back := &kgoRecord{topic: "t"}
	for _, h := range pm.Headers {
		back.add(string(h.Key), h.Value)
	}
	v, _ := pm.Value.Encode()
	got := kafkarecord.Decode(context.Background(), back.record(v))
	if got.UUID != out.UUID || got.Metadata.Get("k") != "v" || string(got.Payload) != "p" {
		t.Fatalf("decoded watermill-kafka's record as %s %v %s", got.UUID, got.Metadata, got.Payload)
	}
}

func TestReservedHeaderRefused(t *testing.T) {
	_, err := kafkarecord.Encode("t", "", "id", map[string]string{kafkarecord.UUIDHeader: "x"}, nil)
	if !errors.Is(err, kafkarecord.ErrReservedHeader) {
		t.Fatalf("err = %v", err)
	}
}

func TestEmptyPayloadIsAnEmptyValue(t *testing.T) {
	rec, err := kafkarecord.Encode("t", "", "id", nil, nil)
	if err != nil || rec.Value == nil || rec.Key != nil {
		t.Fatalf("record %+v, %v", rec, err)
	}
}
