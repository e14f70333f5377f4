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

// TestVersionClaimsStayOnTheirIndexes: the claims of parked replies and of due timers, which
// every orchestrator runs every TimerInterval, cost what their LIMIT asks for however many
// rows wait, with a plan made while the tables were small: an orchestrator that lacks the
// parked version reads a few index pages; one that has it reads its batch's rows, in
// arrival order on saga_parked_version_idx, not every parked reply; timers not yet due are not
// read.
func TestVersionClaimsStayOnTheirIndexes(t *testing.T) {
	db := testdb.New(t)
	o, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: db.Pool, Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	fill := func(from, to int) func() {
		return func() {
			t.Helper()
			for _, sql := range []string{
				`INSERT INTO ` + db.Table("saga") + ` (id, name, version, state, data, steps)
					SELECT 's-' || g, 'checkout', 2, 'running', '{}', '[]' FROM generate_series($1::int, $2::int) g`,
				`INSERT INTO ` + db.Table("saga_parked") + ` (saga_id, dedup_key, message_uuid, metadata, payload, name, version)
					SELECT 's-' || g, 's-' || g || '/reserve/action/1', 'u-' || g, '{}', '', 'checkout', 2 FROM generate_series($1::int, $2::int) g`,
				`INSERT INTO ` + db.Table("saga_timer") + ` (saga_id, kind, action, due_at)
					SELECT 's-' || g, 'step', 'timeout', now() + interval '1 hour' FROM generate_series($1::int, $2::int) g`,
			} {
				if _, err := db.Pool.Exec(context.Background(), sql, from, to); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	fill(1, 30)()
	grown := false
	grow := func() {
		if !grown {
			fill(31, 50_000)()
			grown = true
		}
	}
	claim := saga.ParkedClaimSQL(o)
	if n := testdb.StalePlanBuffers(t, db.Pool, claim, "text[], int[], text[], int", `'{checkout}', '{1}', '{}', 10`, grow); n > 20 {
		t.Errorf("an orchestrator without the parked version read %d buffers among 50,000 parked replies; want a few index pages", n)
	}
	if n := testdb.StalePlanBuffers(t, db.Pool, claim, "text[], int[], text[], int", `'{checkout,checkout}', '{1,2}', '{}', 10`, grow); n > 200 {
		t.Errorf("claiming 10 of 50,000 parked replies read %d buffers; want a few per reply", n)
	}
	if n := testdb.StalePlanBuffers(t, db.Pool, saga.TimerClaimSQL(o), "int, text[], int[]", `10, '{checkout}', '{2}'`, grow); n > 20 {
		t.Errorf("claiming due timers among 50,000 not yet due read %d buffers; want an index page or two", n)
	}
}
