package main

import (
	"testing"

	"github.com/onceflow/onceflow/examples/internal/checkout"
	"github.com/onceflow/onceflow/examples/internal/exampletest"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
)

func TestMain(m *testing.M) { onceflowtest.Main(m) }

// The service as it runs: a process that takes one reserve command from Kafka, answers it on
// the reply topic (through its outbox and relay), and stops on SIGTERM.
func TestServesACommandAndStops(t *testing.T) {
	s := exampletest.Start(t, "github.com/onceflow/onceflow/examples/inventory")
	topics := checkout.NewTopics(s.Prefix)
	ref := outbox.SagaRef{ID: "order-1", Step: "reserve-stock", Phase: outbox.SagaPhaseAction, Attempt: 1}
	s.Produce(t, topics.Reserve, exampletest.Command(t, ref, topics.Replies,
		checkout.ReserveStock{OrderID: "order-1", SKU: "book", Quantity: 2}))
	reply := s.Await(t, topics.Replies, map[string]string{outbox.MetadataSagaID: "order-1"})
	if outcome := exampletest.Header(reply, outbox.MetadataSagaOutcome); outcome != outbox.SagaOutcomeDone {
		t.Fatalf("reply outcome %q (%s), want done", outcome, reply.Value)
	}
	var left int
	if err := s.DB.Pool.QueryRow(t.Context(), `SELECT available FROM `+s.Table("stock")+` WHERE sku = 'book'`).Scan(&left); err != nil || left != 998 {
		t.Fatalf("book stock %d (err %v), want 998", left, err)
	}
	s.Stop(t)
}
