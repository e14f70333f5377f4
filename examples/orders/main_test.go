package main

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/onceflow/onceflow/examples/internal/exampletest"
	"github.com/onceflow/onceflow/onceflowtest"
)

func TestMain(m *testing.M) { onceflowtest.Main(m) }

// The service as it runs: a process on its own schema that takes one order, answers a retry
// with the stored response, shows the order to its owner only, and stops on SIGTERM.
func TestServesAnOrderAndStops(t *testing.T) {
	s := exampletest.Start(t, "github.com/onceflow/onceflow/examples/orders")
	body := `{"sku":"book","quantity":2}`
	status, hdr, resp := s.Do(t, http.MethodPost, "/orders", body, "X-Customer-ID", "alice", "Idempotency-Key", "k-1")
	if status != http.StatusCreated {
		t.Fatalf("POST /orders: %d %s", status, resp)
	}
	var o struct{ ID, SKU, Status string }
	if err := json.Unmarshal([]byte(resp), &o); err != nil || o.ID == "" || o.Status != "pending" || hdr.Get("Location") != "/orders/"+o.ID {
		t.Fatalf("POST /orders: %s (Location %q), err %v", resp, hdr.Get("Location"), err)
	}
	status, hdr, again := s.Do(t, http.MethodPost, "/orders", body, "X-Customer-ID", "alice", "Idempotency-Key", "k-1")
	if status != http.StatusCreated || again != resp || hdr.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry: %d %s (replayed %q), want the first response", status, again, hdr.Get("Idempotent-Replayed"))
	}
	for _, c := range []struct {
		customer string
		want     int
	}{{"alice", http.StatusOK}, {"bob", http.StatusNotFound}} {
		if status, _, b := s.Do(t, http.MethodGet, "/orders/"+o.ID, "", "X-Customer-ID", c.customer); status != c.want {
			t.Errorf("GET as %s: %d %s, want %d", c.customer, status, b, c.want)
		}
	}
	if status, _, b := s.Do(t, http.MethodPost, "/orders", body, "Idempotency-Key", "k-2"); status != http.StatusUnauthorized {
		t.Errorf("POST without X-Customer-ID: %d %s, want 401", status, b)
	}
	s.Stop(t)
}
