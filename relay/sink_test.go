package relay

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
)

// recordingPublisher is an in-memory message.Publisher that fails chosen messages; it tests
// the adapter's own logic (which messages it sends and how it reports), nothing of a broker.
type recordingPublisher struct {
	fail map[string]error // payload → error
	sent []string
}

func (p *recordingPublisher) Publish(_ string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if err := p.fail[string(m.Payload)]; err != nil {
			return err
		}
		p.sent = append(p.sent, string(m.Payload))
	}
	return nil
}

func (p *recordingPublisher) Close() error { return nil }

func msg(id int64, key string) *Message {
	return &Message{ID: id, EventID: fmt.Sprint(id), Topic: "t", Key: key, Payload: []byte(fmt.Sprint(key, id)),
		Metadata: message.Metadata{"partition_key": key}, blockKey: blockKeyOf(key, id)}
}

func TestPublisherSinkKeepsKeyOrder(t *testing.T) {
	tooLarge := sarama.ConfigurationError("Attempt to produce message larger than configured Producer.MaxMessageBytes: 2000000 > 1048576")
	cases := []struct {
		name string
		fail map[string]error
		want []string // outcome per message: ok, held, perm, transient
		sent []string
	}{
		{"all ok", nil, []string{"ok", "ok", "ok", "ok"}, []string{"A1", "B2", "A3", "4"}},
		{"permanent failure holds back its key only", map[string]error{"A1": tooLarge},
			[]string{"perm", "ok", "held", "ok"}, []string{"B2", "4"}},
		{"broker error classified permanent", map[string]error{"B2": sarama.ErrInvalidRecord},
			[]string{"ok", "perm", "ok", "ok"}, []string{"A1", "A3", "4"}},
		{"transient failure holds back the rest", map[string]error{"B2": errors.New("connection refused")},
			[]string{"ok", "transient", "held", "held"}, []string{"A1"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pub := &recordingPublisher{fail: c.fail}
			sink := NewPublisherSink(pub, PublisherSinkConfig{})
			msgs := []*Message{msg(1, "A"), msg(2, "B"), msg(3, "A"), msg(4, "")}
			errs := make([]error, len(msgs))
			sink.Publish(context.Background(), msgs, errs)
			for i, err := range errs {
				got := "ok"
				switch {
				case errors.Is(err, ErrHeldBack):
					got = "held"
				case IsPermanent(err):
					got = "perm"
				case err != nil:
					got = "transient"
				}
				if got != c.want[i] {
					t.Errorf("message %d: %s (%v), want %s", i, got, err, c.want[i])
				}
			}
			if fmt.Sprint(pub.sent) != fmt.Sprint(c.sent) {
				t.Errorf("sent %v, want %v", pub.sent, c.sent)
			}
		})
	}
}

// TestDefaultIsPermanentReservedHeader: watermill-kafka's marshaler refuses a message whose
// metadata uses the header that carries the message UUID, on every attempt. That refusal must
// count toward the row's attempt limit (and park it, as the Kafka sink does), not be retried
// as transient forever with every later row of its key stuck behind it.
func TestDefaultIsPermanentReservedHeader(t *testing.T) {
	m := msg(1, "K")
	m.Metadata[UUIDHeader] = "some-id"
	for name, marshaler := range map[string]kafka.Marshaler{
		"default":      kafka.DefaultMarshaler{},
		"partitioning": kafka.NewWithPartitioningMarshaler(func(string, *message.Message) (string, error) { return "K", nil }),
	} {
		_, err := marshaler.Marshal("t", m.Watermill())
		if err == nil {
			t.Fatalf("%s marshaler accepted metadata %s", name, UUIDHeader)
		}
		err = fmt.Errorf("cannot marshal message %s: %w", m.EventID, err) // as the publisher wraps it
		if !defaultIsPermanent(err) {
			t.Errorf("%s marshaler's refusal %q classified transient: the row would never be parked", name, err)
		}
	}
}
