package inboxprom_test

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/onceflow/onceflow/inbox/inboxprom"
)

func TestMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := inboxprom.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	m.Processed("billing", 3*time.Millisecond)
	m.Duplicate("billing")
	m.Duplicate("billing")
	m.Failed("mailer")
	m.NoKey("mailer")
	m.Poisoned("mailer")
	m.Parked("mailer")
	m.Parked("mailer")
	want := `
# HELP onceflow_inbox_messages_total Messages seen by the inbox middleware, by consumer and result (processed, duplicate, failed, no_key, poisoned, parked).
# TYPE onceflow_inbox_messages_total counter
onceflow_inbox_messages_total{consumer="billing",result="duplicate"} 2
onceflow_inbox_messages_total{consumer="billing",result="processed"} 1
onceflow_inbox_messages_total{consumer="mailer",result="failed"} 1
onceflow_inbox_messages_total{consumer="mailer",result="no_key"} 1
onceflow_inbox_messages_total{consumer="mailer",result="parked"} 2
onceflow_inbox_messages_total{consumer="mailer",result="poisoned"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "onceflow_inbox_messages_total"); err != nil {
		t.Fatal(err)
	}
	if n := testutil.CollectAndCount(reg, "onceflow_inbox_processing_seconds"); n != 1 {
		t.Errorf("%d histogram series, want 1", n)
	}
	if _, err := inboxprom.New(reg); err == nil {
		t.Error("registering twice on one registry succeeded")
	}
}
