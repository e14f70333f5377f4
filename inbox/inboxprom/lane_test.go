package inboxprom_test

import (
	"context"
	"math"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/onceflow/onceflow/inbox/inboxprom"
	"github.com/onceflow/onceflow/internal/testdb"
)

// TestLaneCollector: the gauges follow what waits in each consumer's retry lane — billing has
// two keys (one head with two messages behind it, parked 2 h ago, due in 10 min), audit one
// head 10 min past its due time that nobody applied; a consumer with nothing parked has no
// series.
func TestLaneCollector(t *testing.T) {
	ctx := context.Background()
	db := testdb.New(t)
	park := func(consumer, lane, due, parkedAgo string) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("inbox_parked")+` (consumer, topic, lane, dedup_key, message_uuid, payload, due_at, parked_at)
			VALUES ($1, 'orders', $2, gen_random_uuid()::text, gen_random_uuid()::text, 'x', now() + $3::interval, now() - $4::interval)`,
			consumer, lane, nullIfEmpty(due), parkedAgo); err != nil {
			t.Fatal(err)
		}
	}
	park("billing", "o-1", "10 minutes", "2 hours")
	park("billing", "o-1", "", "90 minutes") // behind the head: no due time of its own
	park("billing", "o-1", "", "80 minutes")
	park("billing", "o-2", "5 minutes", "10 minutes")
	park("audit", "x", "-10 minutes", "15 minutes")

	c, err := inboxprom.NewLaneCollector(db.Pool, db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	want := `
# HELP onceflow_inbox_parked_keys Keys holding parked messages in the consumer's retry lane; counted up to 10,001.
# TYPE onceflow_inbox_parked_keys gauge
onceflow_inbox_parked_keys{consumer="audit"} 1
onceflow_inbox_parked_keys{consumer="billing"} 2
# HELP onceflow_inbox_parked_messages Messages parked in the consumer's retry lane (inbox.RetryAfter), heads and those behind them; counted up to 10,001.
# TYPE onceflow_inbox_parked_messages gauge
onceflow_inbox_parked_messages{consumer="audit"} 1
onceflow_inbox_parked_messages{consumer="billing"} 4
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "onceflow_inbox_parked_messages", "onceflow_inbox_parked_keys"); err != nil {
		t.Fatal(err)
	}
	got := gauges(t, reg)
	for _, w := range []struct {
		series string
		value  float64
	}{
		{"onceflow_inbox_parked_oldest_seconds/billing", 7200},
		{"onceflow_inbox_parked_oldest_seconds/audit", 900},
		{"onceflow_inbox_parked_lag_seconds/billing", 0},
		{"onceflow_inbox_parked_lag_seconds/audit", 600},
	} {
		if v, ok := got[w.series]; !ok || math.Abs(v-w.value) > 30 {
			t.Errorf("%s = %v (present %v), want about %v", w.series, v, ok, w.value)
		}
	}

	// Nothing parked: no series, and no error.
	if _, err := db.Pool.Exec(ctx, `DELETE FROM `+db.Table("inbox_parked")); err != nil {
		t.Fatal(err)
	}
	if n := testutil.CollectAndCount(c); n != 0 {
		t.Errorf("%d series with nothing parked, want 0", n)
	}
}

func TestLaneCollectorRefusesBadInput(t *testing.T) {
	if _, err := inboxprom.NewLaneCollector(nil, ""); err == nil || !strings.Contains(err.Error(), "db is nil") {
		t.Errorf("nil db: %v", err)
	}
	db := testdb.New(t)
	if _, err := inboxprom.NewLaneCollector(db.Pool, `bad"schema`); err == nil {
		t.Error("a schema name that is not an identifier was accepted")
	}
}

func nullIfEmpty(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// gauges gathers reg's gauges by "name/consumer".
func gauges(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "consumer" {
					out[mf.GetName()+"/"+l.GetValue()] = m.GetGauge().GetValue()
				}
			}
		}
	}
	return out
}
