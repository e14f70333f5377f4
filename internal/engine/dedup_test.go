package engine_test

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/engine"
	"github.com/onceflow/onceflow/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

func newRunner(t *testing.T, db *testdb.DB, consumer string) *engine.Runner {
	t.Helper()
	if problems := engine.Check(db.Pool, db.Schema, consumer, 0); len(problems) > 0 {
		t.Fatal(problems)
	}
	return engine.New(engine.Config{Pool: db.Pool, Schema: db.Schema, Consumer: consumer})
}

// QueueClaim and QueueSeen pipeline the dedup statements with the caller's own, with the same
// answers as ClaimTx and SeenTx.
func TestQueueClaimAndSeen(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	r := newRunner(t, db, "billing")
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		var first, second, seenBefore, seenAfter, many []bool
		b := &pgx.Batch{}
		for _, q := range []struct {
			claim bool
			out   *[]bool
		}{{false, &seenBefore}, {true, &first}, {true, &second}, {false, &seenAfter}} {
			queue := r.QueueSeen
			if q.claim {
				queue = r.QueueClaim
			}
			if err := queue(b, []string{"event:q"}, q.out); err != nil {
				return err
			}
		}
		if err := r.QueueClaim(b, []string{"event:b", "event:a", "event:b", "event:q"}, &many); err != nil {
			return err
		}
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return err
		}
		if seenBefore[0] || !first[0] || second[0] || !seenAfter[0] {
			t.Errorf("seen before %v, first claim %v, second claim %v, seen after %v", seenBefore, first, second, seenAfter)
		}
		if want := []bool{true, true, false, false}; !slices.Equal(many, want) {
			t.Errorf("claim of b, a, b, q = %v, want %v (a repeated key is new once, at its first position)", many, want)
		}
		seen, err := r.SeenTx(ctx, tx, "event:a")
		if err != nil || !seen {
			t.Errorf("SeenTx(a) = %v, %v after its claim in the same transaction", seen, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.QueueClaim(&pgx.Batch{}, []string{""}, new([]bool)); !errors.Is(err, engine.ErrNoKey) {
		t.Fatalf("empty key: %v", err)
	}
}

// TestSeenManyProbesEachKey: looking up keys costs a few index pages per key even with a plan
// made while processed_event was small. pgx prepares a statement once per connection, and a
// generic plan for `dedup_key = ANY($2)` made on a small table reads every row of the consumer
// (measured: ~1,000 buffers and 5 ms per lookup at 40k rows, until the next ANALYZE).
func TestSeenManyProbesEachKey(t *testing.T) {
	db := testdb.New(t)
	r := newRunner(t, db, "billing")
	ctx := context.Background()
	fill := func(from, to int) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("processed_event")+` (consumer, dedup_key)
			SELECT 'billing', 'key-' || g FROM generate_series($1::int, $2::int) g`, from, to); err != nil {
			t.Fatal(err)
		}
	}
	fill(1, 30)
	buffers := testdb.StalePlanBuffers(t, db.Pool, r.SeenManySQL(), "text, text[]", `'billing', ARRAY['key-5', 'key-7', 'absent']`,
		func() { fill(31, 40_000) })
	if buffers > 30 {
		t.Errorf("looking up 3 keys among 40,000 with the plan made at 30 rows read %d buffers; want a few per key (index probes)", buffers)
	}
	var seen []bool
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		if err := r.QueueSeen(b, []string{"key-5", "absent", "key-39999", "key-5"}, &seen); err != nil {
			return err
		}
		return tx.SendBatch(ctx, b).Close()
	})
	if err != nil {
		t.Fatal(err)
	}
	if want := []bool{true, false, true, true}; !slices.Equal(seen, want) {
		t.Errorf("QueueSeen = %v, want %v", seen, want)
	}
}
