package inbox_test

import (
	"context"
	"testing"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/testdb"
)

// TestSeenManyProbesEachKey: looking up keys costs a few index pages per key even with a plan
// made while processed_event was small. pgx prepares a statement once per connection, and a
// generic plan for `dedup_key = ANY($2)` made on a small table reads every row of the consumer
// (measured: ~1,000 buffers and 5 ms per lookup at 40k rows, until the next ANALYZE).
func TestSeenManyProbesEachKey(t *testing.T) {
	db := testdb.New(t)
	ib, err := inbox.New(inbox.Config{Pool: db.Pool, Schema: db.Schema, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	fill := func(from, to int) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("processed_event")+` (consumer, dedup_key)
			SELECT 'billing', 'key-' || g FROM generate_series($1::int, $2::int) g`, from, to); err != nil {
			t.Fatal(err)
		}
	}
	fill(1, 30)
	buffers := testdb.StalePlanBuffers(t, db.Pool, inbox.SeenManySQL(ib), "text, text[]", `'billing', ARRAY['key-5', 'key-7', 'absent']`,
		func() { fill(31, 40_000) })
	if buffers > 30 {
		t.Errorf("looking up 3 keys among 40,000 with the plan made at 30 rows read %d buffers; want a few per key (index probes)", buffers)
	}
	seen, err := func() ([]bool, error) {
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			return nil, err
		}
		defer func() { _ = tx.Rollback(ctx) }()
		return ib.SeenManyTx(ctx, tx, "key-5", "absent", "key-39999", "key-5")
	}()
	if err != nil {
		t.Fatal(err)
	}
	if want := []bool{true, false, true, true}; len(seen) != 4 || seen[0] != want[0] || seen[1] != want[1] || seen[2] != want[2] || seen[3] != want[3] {
		t.Errorf("SeenManyTx = %v, want %v", seen, want)
	}
}
