package sagaprom_test

import (
	"context"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/saga/sagaprom"
)

func TestStatesCollector(t *testing.T) {
	db := testdb.New(t)
	if _, err := db.Pool.Exec(context.Background(), `INSERT INTO `+db.Table("saga")+` (id, name, version, state, data, steps) VALUES
		('a', 'checkout', 1, 'running', '{}', '[]'), ('b', 'checkout', 1, 'running', '{}', '[]'),
		('c', 'checkout', 1, 'stuck', '{}', '[]'), ('d', 'checkout', 1, 'completed', '{}', '[]')`); err != nil {
		t.Fatal(err)
	}
	c, err := sagaprom.NewStatesCollector(db.Pool, db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	want := `
# HELP onceflow_saga_active Sagas not finished, by definition and state (running, compensating, stuck), read from the saga table at scrape time.
# TYPE onceflow_saga_active gauge
onceflow_saga_active{saga="checkout",state="running"} 2
onceflow_saga_active{saga="checkout",state="stuck"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "onceflow_saga_active"); err != nil {
		t.Fatal(err)
	}
	if n := testutil.CollectAndCount(c, "onceflow_saga_oldest_active_seconds"); n != 2 {
		t.Errorf("%d oldest series, want 2", n)
	}
}
