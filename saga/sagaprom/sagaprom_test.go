package sagaprom_test

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/onceflow/onceflow/saga"
	"github.com/onceflow/onceflow/saga/sagaprom"
)

func TestMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := sagaprom.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	m.Started("checkout")
	m.Completed("checkout", 20*time.Millisecond)
	m.Compensated("checkout", time.Second)
	m.Stuck("checkout")
	m.Ignored("checkout")
	m.Barrier("inventory", saga.BarrierNullCompensation)
	m.AwaitingVersion("checkout", 2)
	m.AwaitingVersion("checkout", 2)
	want := `
# HELP onceflow_saga_finished_total Sagas that ended, by final state (completed, compensated).
# TYPE onceflow_saga_finished_total counter
onceflow_saga_finished_total{saga="checkout",state="compensated"} 1
onceflow_saga_finished_total{saga="checkout",state="completed"} 1
# HELP onceflow_saga_barrier_total Commands a participant's barrier skipped or short-cut, by outcome (duplicate, null_compensation, hanging_action).
# TYPE onceflow_saga_barrier_total counter
onceflow_saga_barrier_total{consumer="inventory",outcome="null_compensation"} 1
# HELP onceflow_saga_awaiting_version_total Replies that reached an orchestrator without their saga's definition version registered, parked until one that has it applies them (a rolling deploy); growing means no running orchestrator has that version.
# TYPE onceflow_saga_awaiting_version_total counter
onceflow_saga_awaiting_version_total{saga="checkout",version="2"} 2
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "onceflow_saga_finished_total", "onceflow_saga_barrier_total",
		"onceflow_saga_awaiting_version_total"); err != nil {
		t.Fatal(err)
	}
	if n := testutil.CollectAndCount(reg, "onceflow_saga_duration_seconds"); n != 2 {
		t.Errorf("%d duration series, want 2", n)
	}
	if _, err := sagaprom.New(reg); err == nil {
		t.Error("registering twice on one registry succeeded")
	}
}
