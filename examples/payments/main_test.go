package main

import (
	"net/http"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/examples/internal/checkout"
	"github.com/onceflow/onceflow/examples/internal/exampletest"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
)

func TestMain(m *testing.M) { onceflowtest.Main(m) }

// The service as it runs: a process that takes one direct charge, answers its retry with the
// stored response, declines a charge over the limit, charges and refunds for a saga, asks for a
// saga's charge to be retried later while the provider is down, and stops on SIGTERM.
func TestServesPaymentsAndStops(t *testing.T) {
	s := exampletest.Start(t, "github.com/onceflow/onceflow/examples/payments", "-limit", "4000", "-retry-after", "750ms")
	status, _, first := s.Do(t, http.MethodPost, "/payments", `{"amount":700}`, "X-Customer-ID", "alice", "Idempotency-Key", "p-1")
	if status != http.StatusCreated || !strings.Contains(first, `"external_payment_id":"ch_`) {
		t.Fatalf("POST /payments: %d %s", status, first)
	}
	status, hdr, again := s.Do(t, http.MethodPost, "/payments", `{"amount":700}`, "X-Customer-ID", "alice", "Idempotency-Key", "p-1")
	if status != http.StatusCreated || again != first || hdr.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry: %d %s, want the first response replayed", status, again)
	}
	if status, _, b := s.Do(t, http.MethodPost, "/payments", `{"amount":3500}`, "X-Customer-ID", "alice", "Idempotency-Key", "p-2"); status != http.StatusPaymentRequired {
		t.Fatalf("a charge over the limit: %d %s, want 402", status, b)
	}
	var payments int
	if err := s.DB.Pool.QueryRow(t.Context(), `SELECT count(*) FROM `+s.Table("payment")).Scan(&payments); err != nil || payments != 1 {
		t.Fatalf("%d payments (err %v), want 1", payments, err)
	}

	// The saga side, as the orchestrator drives it: a charge, the same charge again (skipped
	// by the barrier), then its refund; the provider ends with one charge, refunded.
	topics := checkout.NewTopics(s.Prefix)
	charge := outbox.SagaRef{ID: "order-7", Step: "charge", Phase: outbox.SagaPhaseAction, Attempt: 1}
	cmd := exampletest.Command(t, charge, topics.Replies, checkout.Charge{OrderID: "order-7", CustomerID: "bob", Amount: 2500})
	s.Produce(t, topics.Charge, cmd)
	s.Produce(t, topics.Charge, cmd) // a redelivery
	reply := s.Await(t, topics.Replies, map[string]string{outbox.MetadataSagaID: "order-7", outbox.MetadataSagaPhase: "action"})
	if got := exampletest.Header(reply, outbox.MetadataSagaOutcome); got != outbox.SagaOutcomeDone {
		t.Fatalf("charge outcome %q (%s), want done", got, reply.Value)
	}
	refund := charge
	refund.Phase = outbox.SagaPhaseCompensation
	s.Produce(t, topics.Refund, exampletest.Command(t, refund, topics.Replies, checkout.Refund{OrderID: "order-7"}))
	s.Await(t, topics.Replies, map[string]string{outbox.MetadataSagaID: "order-7", outbox.MetadataSagaPhase: "compensation"})
	var paymentStatus string
	var requests int
	var refunded bool
	err := s.DB.Pool.QueryRow(t.Context(), `SELECT p.status, c.requests, c.refunded FROM `+s.Table("payment")+` p
		JOIN `+s.Table("fake_provider_charge")+` c ON c.external_id = p.external_payment_id
		WHERE p.order_id = 'order-7'`).Scan(&paymentStatus, &requests, &refunded)
	if err != nil || paymentStatus != "refunded" || requests != 1 || !refunded {
		t.Fatalf("payment %q, provider requests %d, refunded %v (err %v); want refunded, 1, true", paymentStatus, requests, refunded, err)
	}

	// The provider goes down. A direct charge gets 503 (not stored: the same key may be sent
	// again); a saga's charge asks to be retried later (inbox.RetryAfter), answered at once as
	// a retry carrying the wait, nothing charged. Back up, the step's next attempt charges.
	ctx := t.Context()
	if _, err := s.DB.Pool.Exec(ctx, `INSERT INTO `+s.Table("fake_provider_outage")+` (down_until) VALUES (now() + interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	if status, hdr, b := s.Do(t, http.MethodPost, "/payments", `{"amount":100}`, "X-Customer-ID", "alice", "Idempotency-Key", "p-3"); status != http.StatusServiceUnavailable || hdr.Get("Retry-After") != "1" {
		t.Fatalf("a direct charge while the provider is down: %d (Retry-After %q) %s, want 503", status, hdr.Get("Retry-After"), b)
	}
	later := outbox.SagaRef{ID: "order-8", Step: "charge", Phase: outbox.SagaPhaseAction, Attempt: 1}
	s.Produce(t, topics.Charge, exampletest.Command(t, later, topics.Replies, checkout.Charge{OrderID: "order-8", CustomerID: "carol", Amount: 900}))
	reply = s.Await(t, topics.Replies, map[string]string{outbox.MetadataSagaID: "order-8", outbox.MetadataSagaAttempt: "1"})
	if got, wait, reason := exampletest.Header(reply, outbox.MetadataSagaOutcome), exampletest.Header(reply, outbox.MetadataSagaRetryAfter),
		exampletest.Header(reply, outbox.MetadataSagaReason); got != outbox.SagaOutcomeRetry || wait != "750ms" || !strings.Contains(reason, "unavailable") {
		t.Fatalf("charge while the provider is down: outcome %q, retry after %q, reason %q; want retry after 750ms, unavailable", got, wait, reason)
	}
	if _, err := s.DB.Pool.Exec(ctx, `UPDATE `+s.Table("fake_provider_outage")+` SET down_until = now()`); err != nil {
		t.Fatal(err)
	}
	later.Attempt = 2
	s.Produce(t, topics.Charge, exampletest.Command(t, later, topics.Replies, checkout.Charge{OrderID: "order-8", CustomerID: "carol", Amount: 900}))
	reply = s.Await(t, topics.Replies, map[string]string{outbox.MetadataSagaID: "order-8", outbox.MetadataSagaAttempt: "2"})
	if got := exampletest.Header(reply, outbox.MetadataSagaOutcome); got != outbox.SagaOutcomeDone {
		t.Fatalf("the charge's next attempt, the provider back: outcome %q (%s), want done", got, reply.Value)
	}
	var refused int
	err = s.DB.Pool.QueryRow(ctx, `SELECT (SELECT sum(refused) FROM `+s.Table("fake_provider_outage")+`),
		(SELECT requests FROM `+s.Table("fake_provider_charge")+` WHERE idempotency_key = 'saga:order-8:charge')`).Scan(&refused, &requests)
	if err != nil || refused != 2 || requests != 1 {
		t.Fatalf("the provider refused %d requests and got the charge %d times (err %v); want 2 (the direct one and the saga's) and 1", refused, requests, err)
	}
	s.Stop(t)
}
