package saga_test

import (
	"context"
	"testing"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

// TestBarrierLookupsProbeEachKey: a participant's read of its actions' results costs a few
// index pages per key even with a plan made while
// processed_event was small (pgx prepares once per connection; a generic plan for
// `dedup_key = ANY($2)` made on a small table reads every row of the consumer).
func TestBarrierLookupsProbeEachKey(t *testing.T) {
	db := testdb.New(t)
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	p, err := saga.NewParticipant(saga.ParticipantConfig{Pool: db.Pool, Schema: db.Schema, Consumer: "stock", Writer: w})
	if err != nil {
		t.Fatal(err)
	}
	fill := func(from, to int) {
		t.Helper()
		if _, err := db.Pool.Exec(context.Background(), `INSERT INTO `+db.Table("processed_event")+` (consumer, dedup_key, result)
			SELECT 'stock', 'key-' || g, '{}' FROM generate_series($1::int, $2::int) g`, from, to); err != nil {
			t.Fatal(err)
		}
	}
	fill(1, 30)
	buffers := testdb.StalePlanBuffers(t, db.Pool, saga.ResultSQL(p), "text, text[]", `'stock', ARRAY['key-5', 'key-7', 'absent']`,
		func() { fill(31, 40_000) })
	if buffers > 30 {
		t.Errorf("3 keys among 40,000 with the plan made at 30 rows read %d buffers; want a few per key (index probes)", buffers)
	}
}
