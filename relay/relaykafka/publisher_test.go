package relaykafka_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// recordingPublisher is an in-memory message.Publisher that fails chosen messages.
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

func msg(id int64, key string) *relay.Message {
	return &relay.Message{ID: id, EventID: fmt.Sprint(id), Topic: "t", Key: key, Payload: []byte(fmt.Sprint(key, id)),
		Metadata: message.Metadata{"partition_key": key}}
}

// tooLarge is what sarama's producer returns, client-side, for a message over
// Producer.MaxMessageBytes.
var tooLarge = sarama.ConfigurationError("Attempt to produce message larger than configured Producer.MaxMessageBytes: 2000000 > 1048576")

// TestPublisherSinkClassifiesSaramaErrors: over a watermill-kafka publisher, sarama's
// refusals count toward parking and hold back only their key; other errors are transient.
func TestPublisherSinkClassifiesSaramaErrors(t *testing.T) {
	cases := []struct {
		name string
		fail map[string]error
		want []string // outcome per message: ok, held, undeliverable, transient
		sent []string
	}{
		{"all ok", nil, []string{"ok", "ok", "ok", "ok"}, []string{"A1", "B2", "A3", "4"}},
		{"client-side too large holds back its key only", map[string]error{"A1": tooLarge},
			[]string{"undeliverable", "ok", "held", "ok"}, []string{"B2", "4"}},
		{"broker error classified undeliverable", map[string]error{"B2": sarama.ErrInvalidRecord},
			[]string{"ok", "undeliverable", "ok", "ok"}, []string{"A1", "A3", "4"}},
		{"transient failure holds back the rest", map[string]error{"B2": errors.New("connection refused")},
			[]string{"ok", "transient", "held", "held"}, []string{"A1"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pub := &recordingPublisher{fail: c.fail}
			sink := relaykafka.NewPublisherSink(pub)
			msgs := []*relay.Message{msg(1, "A"), msg(2, "B"), msg(3, "A"), msg(4, "")}
			errs := make([]error, len(msgs))
			sink.Publish(context.Background(), msgs, errs)
			for i, err := range errs {
				got := "ok"
				switch {
				case errors.Is(err, relay.ErrHeldBack):
					got = "held"
				case relay.IsUndeliverable(err):
					got = "undeliverable"
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

func TestSaramaUndeliverable(t *testing.T) {
	cases := []struct {
		err  error
		want bool
	}{
		{nil, false},
		{tooLarge, true},
		{fmt.Errorf("cannot produce message: %w", sarama.ErrMessageSizeTooLarge), true},
		{sarama.ErrInvalidMessage, true},
		{sarama.ErrInvalidRecord, true},
		{sarama.ErrInvalidTopic, true},
		{sarama.ErrPolicyViolation, true},
		{sarama.ErrInvalidTimestamp, true},
		{sarama.ErrMessageSetSizeTooLarge, true},
		{relay.Undeliverable(errors.New("marked by a wrapper")), true},
		{sarama.ErrNotLeaderForPartition, false},
		{sarama.ErrRequestTimedOut, false},
		{sarama.ErrOutOfBrokers, false},
		{sarama.ConfigurationError("Producer.Retry.Max must be >= 0"), false},
		{errors.New("dial tcp: connection refused"), false},
	}
	for _, c := range cases {
		if got := relaykafka.SaramaUndeliverable(c.err); got != c.want {
			t.Errorf("SaramaUndeliverable(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}

// TestSaramaUndeliverableReservedHeader: watermill-kafka's marshaler refuses a message whose
// metadata uses the header that carries the message UUID, on every attempt. That refusal must
// count toward the row's attempt limit (and park it, as the Kafka sink does), not be retried
// as transient forever with every later row of its key stuck behind it.
func TestSaramaUndeliverableReservedHeader(t *testing.T) {
	m := msg(1, "K")
	m.Metadata[relaykafka.UUIDHeader] = "some-id"
	if relaykafka.UUIDHeader != kafka.UUIDHeaderKey {
		t.Fatalf("UUIDHeader %q, watermill-kafka uses %q", relaykafka.UUIDHeader, kafka.UUIDHeaderKey)
	}
	for name, marshaler := range map[string]kafka.Marshaler{
		"default":      kafka.DefaultMarshaler{},
		"partitioning": kafka.NewWithPartitioningMarshaler(func(string, *message.Message) (string, error) { return "K", nil }),
	} {
		_, err := marshaler.Marshal("t", m.Watermill())
		if err == nil {
			t.Fatalf("%s marshaler accepted metadata %s", name, relaykafka.UUIDHeader)
		}
		err = fmt.Errorf("cannot marshal message %s: %w", m.EventID, err) // as the publisher wraps it
		if !relaykafka.SaramaUndeliverable(err) {
			t.Errorf("%s marshaler's refusal %q classified transient: the row would never be parked", name, err)
		}
	}
}
