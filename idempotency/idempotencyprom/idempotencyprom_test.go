package idempotencyprom_test

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/idempotency/idempotencyprom"
)

func TestMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := idempotencyprom.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	m.Observe(idempotency.OutcomeStored, 10*time.Millisecond)
	m.Observe(idempotency.OutcomeReplayed, time.Millisecond)
	m.Observe(idempotency.OutcomeReplayed, time.Millisecond)
	want := `
# HELP onceflow_idempotency_requests_total Requests with an Idempotency-Key by outcome (stored, replayed, in_flight, mismatch, not_stored, not_replayed, rejected, storage_error, canceled, panic, tx_misuse).
# TYPE onceflow_idempotency_requests_total counter
onceflow_idempotency_requests_total{outcome="in_flight"} 0
onceflow_idempotency_requests_total{outcome="mismatch"} 0
onceflow_idempotency_requests_total{outcome="replayed"} 2
onceflow_idempotency_requests_total{outcome="storage_error"} 0
onceflow_idempotency_requests_total{outcome="stored"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "onceflow_idempotency_requests_total"); err != nil {
		t.Fatal(err)
	}
	if n := testutil.CollectAndCount(reg, "onceflow_idempotency_request_seconds"); n != 2 {
		t.Errorf("%d duration series, want 2", n)
	}
	if _, err := idempotencyprom.New(reg); err == nil {
		t.Error("registering twice on one registry succeeded")
	}
}
