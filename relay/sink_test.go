package relay

import (
	"context"
	"errors"
	"fmt"
	"testing"

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

// msg builds a message as a Sink outside the relay would see it: without the fields the
// claim fills in, so the sink must derive order chains from Key and ID.
func msg(id int64, key string) *Message {
	return &Message{ID: id, EventID: fmt.Sprint(id), Topic: "t", Key: key, Payload: []byte(fmt.Sprint(key, id)),
		Metadata: message.Metadata{"partition_key": key}}
}

func TestPublisherSinkKeepsKeyOrder(t *testing.T) {
	refused := Undeliverable(errors.New("message too large"))
	brokerRefusal := errors.New("broker: invalid record")
	cases := []struct {
		name            string
		isUndeliverable func(error) bool // nil: the default
		fail            map[string]error
		want            []string // outcome per message: ok, held, undeliverable, transient
		sent            []string
	}{
		{"all ok", nil, nil, []string{"ok", "ok", "ok", "ok"}, []string{"A1", "B2", "A3", "4"}},
		{"undeliverable failure holds back its key only", nil, map[string]error{"A1": refused},
			[]string{"undeliverable", "ok", "held", "ok"}, []string{"B2", "4"}},
		{"unmarked error is transient by default", nil, map[string]error{"B2": brokerRefusal},
			[]string{"ok", "transient", "held", "held"}, []string{"A1"}},
		{"custom classifier", func(err error) bool { return errors.Is(err, brokerRefusal) }, map[string]error{"B2": brokerRefusal},
			[]string{"ok", "undeliverable", "ok", "ok"}, []string{"A1", "A3", "4"}},
		{"transient failure holds back the rest", nil, map[string]error{"B2": errors.New("connection refused")},
			[]string{"ok", "transient", "held", "held"}, []string{"A1"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pub := &recordingPublisher{fail: c.fail}
			sink := NewPublisherSink(pub, PublisherSinkConfig{IsUndeliverable: c.isUndeliverable})
			msgs := []*Message{msg(1, "A"), msg(2, "B"), msg(3, "A"), msg(4, "")}
			errs := make([]error, len(msgs))
			sink.Publish(context.Background(), msgs, errs)
			for i, err := range errs {
				got := "ok"
				switch {
				case errors.Is(err, ErrHeldBack):
					got = "held"
				case IsUndeliverable(err):
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

// TestUndeliverableWrapsOnce: a publisher's error already marked undeliverable is passed on
// as it is, not wrapped a second time (the row's last_error stays readable).
func TestUndeliverableWrapsOnce(t *testing.T) {
	refused := Undeliverable(errors.New("message too large"))
	sink := NewPublisherSink(&recordingPublisher{fail: map[string]error{"A1": refused}}, PublisherSinkConfig{})
	errs := make([]error, 1)
	sink.Publish(context.Background(), []*Message{msg(1, "A")}, errs)
	if errs[0] != refused {
		t.Fatalf("error %q, want %q", errs[0], refused)
	}
	if Undeliverable(nil) != nil || IsUndeliverable(nil) || IsUndeliverable(errors.New("x")) {
		t.Fatal("nil or unmarked errors reported undeliverable")
	}
	if !IsUndeliverable(fmt.Errorf("send: %w", refused)) {
		t.Fatal("a wrapped UndeliverableError is not recognised")
	}
}
