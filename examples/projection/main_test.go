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

// The service as it runs: a process that applies one OrderCreated event and one reminder
// (each delivered twice: each counts once), serves the customer's count, and stops on SIGTERM.
func TestServesAnEventAndStops(t *testing.T) {
	s := exampletest.Start(t, "github.com/onceflow/onceflow/examples/projection")
	payload, _ := json.Marshal(checkout.OrderEvent{Type: checkout.OrderCreated, OrderID: "o-1", CustomerID: "alice",
		SKU: "book", Quantity: 1, Amount: 1800, Status: "pending", Version: 1})
	msg := outbox.SetPartitionKey(outbox.NewMessage(payload), "o-1")
	topics := checkout.NewTopics(s.Prefix)
	s.Produce(t, topics.OrderEvents, msg)
	s.Produce(t, topics.OrderEvents, msg) // a redelivery: same event id
	due := time.Now().Add(-time.Second).UTC().Truncate(time.Microsecond)
	payload, _ = json.Marshal(checkout.OrderReminder{OrderID: "o-1", CustomerID: "alice", DueAt: due})
	reminder := outbox.SetPartitionKey(outbox.NewMessage(payload), "o-1")
	s.Produce(t, topics.Reminders, reminder)
	s.Produce(t, topics.Reminders, reminder)
	deadline := time.Now().Add(20 * time.Second)
	for {
		var processed, dups int64
		_, _, b := s.Do(t, http.MethodGet, "/debug/counters", "")
		var c map[string]int64
		if err := json.Unmarshal([]byte(b), &c); err == nil {
			processed, dups = c["processed"], c["inbox_duplicates"]
		}
		if processed+dups == 4 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("counters %s after 20s, want two processed and two duplicates", b)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if status, _, b := s.Do(t, http.MethodGet, "/customers/alice/orders", ""); status != http.StatusOK || !strings.Contains(b, `"orders":1`) {
		t.Fatalf("GET /customers/alice/orders: %d %s, want 1 order", status, b)
	}
	var reminders int
	var dueAt time.Time
	err := s.DB.Pool.QueryRow(t.Context(), `SELECT reminders, due_at FROM `+s.Table("order_reminder")+` WHERE order_id = 'o-1'`).Scan(&reminders, &dueAt)
	if err != nil || reminders != 1 || !dueAt.Equal(due) {
		t.Fatalf("order o-1: %d reminders due %s (err %v), want 1 due %s", reminders, dueAt, err, due)
	}
	s.Stop(t)
}
