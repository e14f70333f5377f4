package relayprom_test

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relayprom"
)

func TestMetricsExported(t *testing.T) {
	reg := prometheus.NewRegistry()
	pm, err := relayprom.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	var m relay.Metrics = pm
	m.Published(3, 2*time.Millisecond)
	m.Published(2, 4*time.Millisecond)
	m.Failed(relay.FailureTransient, 4)
	m.Parked(1)
	m.OwnedShards(21)
	m.Pending(1234, 90*time.Second)
	m.ParkedRows(7)
	m.ScheduledRows(1_000_000, 3)
	m.LeaseRenewal(true)
	m.LeaseRenewal(true)
	m.LeaseRenewal(false)
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range families {
		for _, mt := range f.GetMetric() {
			name := f.GetName()
			for _, l := range mt.GetLabel() {
				name += "{" + l.GetName() + "=" + l.GetValue() + "}"
			}
			switch {
			case mt.Counter != nil:
				got[name] = mt.Counter.GetValue()
			case mt.Gauge != nil:
				got[name] = mt.Gauge.GetValue()
			case mt.Histogram != nil:
				got[name+"_count"] = float64(mt.Histogram.GetSampleCount())
			}
		}
	}
	want := map[string]float64{
		"onceflow_relay_published_total":                     5,
		"onceflow_relay_publish_seconds_count":               2,
		"onceflow_relay_errors_total{kind=transient}":        4,
		"onceflow_relay_errors_total{kind=undeliverable}":    0,
		"onceflow_relay_errors_total{kind=database}":         0,
		"onceflow_relay_parked_total":                        1,
		"onceflow_relay_owned_shards":                        21,
		"onceflow_relay_pending_rows":                        1234,
		"onceflow_relay_oldest_pending_seconds":              90,
		"onceflow_relay_parked_rows":                         7,
		"onceflow_relay_lease_renewals_total{result=ok}":     2,
		"onceflow_relay_lease_renewals_total{result=failed}": 1,
	}
	for k, v := range want {
		if g, ok := got[k]; !ok || g != v {
			t.Errorf("%s = %v (present %v), want %v", k, g, ok, v)
		}
	}
	for k := range got {
		if !strings.HasPrefix(k, "onceflow_relay_") {
			t.Errorf("unexpected metric %s", k)
		}
	}
	// Registering twice with the same registry is reported, not a panic.
	if _, err := relayprom.New(reg); err == nil {
		t.Fatal("second New on the same registry returned no error")
	}
}

// TestNewNilRegistersOnDefault: nil means prometheus.DefaultRegisterer, as in inboxprom.
func TestNewNilRegistersOnDefault(t *testing.T) {
	reg := prometheus.NewRegistry()
	prev := prometheus.DefaultRegisterer
	prometheus.DefaultRegisterer = reg // not parallel: swaps the global for this test
	t.Cleanup(func() { prometheus.DefaultRegisterer = prev })
	m, err := relayprom.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	m.Parked(2)
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, f := range families {
		if f.GetName() == "onceflow_relay_parked_total" {
			found = f.GetMetric()[0].GetCounter().GetValue() == 2
		}
	}
	if !found {
		t.Fatal("onceflow_relay_parked_total = 2 not on the default registry")
	}
}
