package main

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/examples/internal/checkout"
	"github.com/onceflow/onceflow/examples/internal/exampletest"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
)

func TestMain(m *testing.M) { onceflowtest.Main(m) }

// The service as it runs: a process that applies one OrderCreated event (delivered twice: it
// counts once), serves the customer's count, and stops on SIGTERM.
func TestServesAnEventAndStops(t *testing.T) {
	s := exampletest.Start(t, "github.com/onceflow/onceflow/examples/projection")
	payload, _ := json.Marshal(checkout.OrderEvent{Type: checkout.OrderCreated, OrderID: "o-1", CustomerID: "alice",
		SKU: "book", Quantity: 1, Amount: 1800, Status: "pending", Version: 1})
	msg := outbox.SetPartitionKey(outbox.NewMessage(payload), "o-1")
	topic := checkout.NewTopics(s.Prefix).OrderEvents
	s.Produce(t, topic, msg)
	s.Produce(t, topic, msg) // a redelivery: same event id
	deadline := time.Now().Add(20 * time.Second)
	for {
		var processed, dups int64
		_, _, b := s.Do(t, http.MethodGet, "/debug/counters", "")
		var c map[string]int64
		if err := json.Unmarshal([]byte(b), &c); err == nil {
			processed, dups = c["processed"], c["inbox_duplicates"]
		}
		if processed+dups == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("counters %s after 20s, want one processed and one duplicate", b)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if status, _, b := s.Do(t, http.MethodGet, "/customers/alice/orders", ""); status != http.StatusOK || !strings.Contains(b, `"orders":1`) {
		t.Fatalf("GET /customers/alice/orders: %d %s, want 1 order", status, b)
	}
	s.Stop(t)
}
