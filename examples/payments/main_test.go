package main

import (
	"net/http"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/examples/internal/exampletest"
	"github.com/onceflow/onceflow/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// The service as it runs: a process that takes one direct charge, answers its retry with the
// stored response, declines a charge over the limit, and stops on SIGTERM.
func TestServesAPaymentAndStops(t *testing.T) {
	s := exampletest.Start(t, "github.com/onceflow/onceflow/examples/payments", "-limit", "1000")
	status, _, first := s.Do(t, http.MethodPost, "/payments", `{"amount":700}`, "X-Customer-ID", "alice", "Idempotency-Key", "p-1")
	if status != http.StatusCreated || !strings.Contains(first, `"external_payment_id":"ch_`) {
		t.Fatalf("POST /payments: %d %s", status, first)
	}
	status, hdr, again := s.Do(t, http.MethodPost, "/payments", `{"amount":700}`, "X-Customer-ID", "alice", "Idempotency-Key", "p-1")
	if status != http.StatusCreated || again != first || hdr.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry: %d %s, want the first response replayed", status, again)
	}
	if status, _, b := s.Do(t, http.MethodPost, "/payments", `{"amount":700}`, "X-Customer-ID", "alice", "Idempotency-Key", "p-2"); status != http.StatusPaymentRequired {
		t.Fatalf("a charge over the limit: %d %s, want 402", status, b)
	}
	var payments int
	if err := s.DB.Pool.QueryRow(t.Context(), `SELECT count(*) FROM `+s.DB.Table("payment")).Scan(&payments); err != nil || payments != 1 {
		t.Fatalf("%d payments (err %v), want 1", payments, err)
	}
	s.Stop(t)
}
