package relaykafka

import (
	"testing"

	"github.com/onceflow/onceflow/relay"
)

// TestTraceContextHeadersAreVerbatim: the creation context stored in the outbox metadata
// goes out as the traceparent/tracestate headers byte for byte, once each, so the
// consumer's process span is a child of the producer's create span.
func TestTraceContextHeadersAreVerbatim(t *testing.T) {
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	const ts = "vendor=opaque,other=x"
	s := &Sink{maxBytes: DefaultMaxMessageBytes}
	rec, err := s.record(&relay.Message{ID: 1, EventID: "0190a0a0-0000-7000-8000-000000000001", Topic: "t",
		Payload: []byte("x"), Metadata: map[string]string{"traceparent": tp, "tracestate": ts}})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][]string{}
	for _, h := range rec.Headers {
		got[h.Key] = append(got[h.Key], string(h.Value))
	}
	if len(got["traceparent"]) != 1 || got["traceparent"][0] != tp || len(got["tracestate"]) != 1 || got["tracestate"][0] != ts {
		t.Errorf("headers %v, want traceparent %q and tracestate %q once each", got, tp, ts)
	}
}
