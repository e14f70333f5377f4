package inbox

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/testdb"
)

// TestCleanerBatchCostIsFlat: with synchronized sequential scans off (what a server with
// large shared_buffers effectively has), the cleaner's batches touch as many buffers at the
// end of a run as at its start, and the batch that finishes the run does not scan the table.
// Counted in buffers with EXPLAIN (ANALYZE, BUFFERS) of the cleaner's own statement, in a
// transaction rolled back, so the test does not depend on the machine's speed.
func TestCleanerBatchCostIsFlat(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	const rows, batch = 100_000, 1000
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Schema+`.processed_event (consumer, dedup_key, processed_at)
		SELECT 'c', 'k-' || g, now() - interval '100 hours' + g * interval '1 ms' FROM generate_series(1, $1) g
		UNION ALL SELECT 'c', 'young-' || g, now() FROM generate_series(1, 1000) g`, rows); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `ANALYZE `+db.Schema+`.processed_event`); err != nil {
		t.Fatal(err)
	}
	c, err := NewCleaner(CleanerConfig{Pool: db.Pool, Schema: db.Schema, BatchSize: batch})
	if err != nil {
		t.Fatal(err)
	}
	args := func(pos any) []any { return append(append([]any{pos}, c.args...), batch) }
	buffers := func(pos any) int {
		t.Helper()
		var plan string
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SET LOCAL synchronize_seqscans = off`); err != nil {
				return err
			}
			if err := tx.QueryRow(ctx, `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) `+c.sql, args(pos)...).Scan(&plan); err != nil {
				return err
			}
			return errRollback
		})
		if err != errRollback {
			t.Fatal(err)
		}
		var out []struct {
			Plan struct {
				Hit  int `json:"Shared Hit Blocks"`
				Read int `json:"Shared Read Blocks"`
			}
		}
		if err := json.Unmarshal([]byte(plan), &out); err != nil || len(out) != 1 {
			t.Fatalf("explain output %q: %v", plan, err)
		}
		return out[0].Plan.Hit + out[0].Plan.Read
	}

	first := buffers(nil)
	// Delete all but the last batch the way Clean does, then measure the last two batches.
	var pos any
	for range rows/batch - 1 {
		rs, err := db.Pool.Query(ctx, c.sql, args(pos)...)
		if err != nil {
			t.Fatal(err)
		}
		var last time.Time
		for rs.Next() {
			var at time.Time
			if err := rs.Scan(&at); err != nil {
				t.Fatal(err)
			}
			last = at
		}
		if rs.Err() != nil {
			t.Fatal(rs.Err())
		}
		pos = last
	}
	lastBatch := buffers(pos)
	var end time.Time
	if err := db.Pool.QueryRow(ctx, `SELECT max(processed_at) FROM `+db.Schema+`.processed_event WHERE dedup_key LIKE 'k-%'`).Scan(&end); err != nil {
		t.Fatal(err)
	}
	finishing := buffers(end.Add(time.Millisecond)) // nothing left to delete: the run ends here
	t.Logf("buffers: first batch %d, last batch %d, finishing batch %d", first, lastBatch, finishing)
	if lastBatch > 2*first || finishing > 20 {
		t.Fatalf("batch cost grows: first %d buffers, last %d, finishing %d (want last ≤ 2× first, finishing a few index pages)", first, lastBatch, finishing)
	}
}

var errRollback = errRollbackT{}

type errRollbackT struct{}

func (errRollbackT) Error() string { return "rollback" }
