package relay

import (
	"context"
	"encoding/json"
	"errors"
	"hash/fnv"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/testdb"
)

// ackSink acknowledges every message except those of the refused keys, which it refuses as
// undeliverable (and holds back the rest of their key). It records each call's bytes.
type ackSink struct {
	refuse map[string]bool
	calls  []int // payload bytes per Publish call
}

func (s *ackSink) Publish(_ context.Context, msgs []*Message, errs []error) {
	n := 0
	for _, m := range msgs {
		n += len(m.Payload)
	}
	s.calls = append(s.calls, n)
	failed := map[string]bool{}
	for i, m := range msgs {
		switch {
		case failed[m.Key]:
			errs[i] = ErrHeldBack
		case s.refuse[m.Key]:
			failed[m.Key] = true
			errs[i] = Undeliverable(errors.New("refused"))
		}
	}
}

func (*ackSink) Close() error { return nil }

func fnv32(key string) int64 {
	h := fnv.New32a()
	h.Write([]byte(key))
	return int64(h.Sum32())
}

// keysIn returns n keys whose shard (of 64) satisfies in.
func keysIn(n int, in func(shard int) bool) (keys []string, hashes []int64) {
	for i := 0; len(keys) < n; i++ {
		k := "key-" + string(rune('a'+i%26)) + string(rune('a'+i/26%26)) + string(rune('a'+i/676%26))
		if h := fnv32(k); in(int(h % 64)) {
			keys, hashes = append(keys, k), append(hashes, h)
		}
	}
	return keys, hashes
}

// claimBuffers is the number of shared buffers a cursor claim (late-commit lookup included)
// touches, under the planner settings the relay runs it with and with a generic plan, which
// is what the relay's prepared statements get after five executions (a plan made without the
// parameters' values must not walk the table either).
func claimBuffers(t *testing.T, db *testdb.DB, r *Relay, snap snapshot, cur cursor, blocked blockedSet) int {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SET LOCAL plan_cache_mode = force_generic_plan`); err != nil {
		t.Fatal(err)
	}
	explain := func(name, sql string, args []any) int {
		if _, err := tx.Exec(ctx, "PREPARE "+name+" AS "+sql); err != nil {
			t.Fatal(err)
		}
		defer func() { _, _ = tx.Exec(ctx, "DEALLOCATE "+name) }() // prepared statements outlive the transaction
		lits := make([]string, len(args))
		for i, a := range args {
			lits[i] = sqlLiteral(t, a)
		}
		var plan string
		if err := tx.QueryRow(ctx, "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE "+name+"("+strings.Join(lits, ", ")+")").Scan(&plan); err != nil {
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
	if _, err := tx.Exec(ctx, planSettings); err != nil {
		t.Fatal(err)
	}
	sql, args := r.q.nextSQL(snap, r.cfg.Shards, cur, blocked, r.cfg.BatchSize, r.cfg.MaxBatchBytes)
	return explain("claim_probe", sql, args)
}

// sqlLiteral writes a claim argument as an SQL literal, for EXECUTE.
func sqlLiteral(t *testing.T, v any) string {
	t.Helper()
	quote := func(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
	switch v := v.(type) {
	case nil:
		return "NULL"
	case int:
		return strconv.Itoa(v)
	case int64:
		return strconv.FormatInt(v, 10)
	case string:
		return quote(v)
	case []string:
		q := make([]string, len(v))
		for i, s := range v {
			q[i] = quote(s)
		}
		return "ARRAY[" + strings.Join(q, ", ") + "]::text[]"
	case []int:
		q := make([]string, len(v))
		for i, n := range v {
			q[i] = strconv.Itoa(n)
		}
		return "ARRAY[" + strings.Join(q, ", ") + "]::int[]"
	case []int64:
		q := make([]string, len(v))
		for i, n := range v {
			q[i] = strconv.FormatInt(n, 10)
		}
		return "ARRAY[" + strings.Join(q, ", ") + "]::bigint[]"
	}
	t.Fatalf("no literal for %T", v)
	return ""
}

// TestClaimCostIndependentOfBacklog drives the publishing loop by hand on an outbox where
// 20,000 rows of another relay's shards and 5,000 rows of a blocked key lie ahead of 20,000
// rows of this relay's shards. Once the relay has drained its rows, its claim touches a few
// index pages: not the deleted rows, not the other shards' rows, not the blocked key's
// backlog. A claim from the start of the table (what the relay did before the cursor) touches
// all of them. Counted in buffers, so the test does not depend on the machine's speed.
func TestClaimCostIndependentOfBacklog(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	r, err := New(Config{Pool: db.Pool, Sink: &ackSink{refuse: map[string]bool{"blocked": true}}, Schema: db.Schema,
		Logger: slog.New(slog.DiscardHandler), InstanceID: "me", MaxAttempts: 1 << 20, RetryBackoff: time.Hour, MaxRetryBackoff: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.prepare(ctx); err != nil {
		t.Fatal(err)
	}
	// Another live relay holds shards 0..31.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Schema+`.relay_member (id, expires_at) VALUES ('other', now() + interval '1 hour');
		UPDATE `+db.Schema+`.relay_lease SET owner = 'other', epoch = 1, expires_at = now() + interval '1 hour' WHERE shard < 32`); err != nil {
		t.Fatal(err)
	}
	if err := r.leases.tick(ctx); err != nil {
		t.Fatal(err)
	}
	if n := len(r.leases.owned); n != 32 {
		t.Fatalf("relay owns %d shards, want 32", n)
	}
	insert := func(keys []string, hashes []int64, n int) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Schema+`.outbox (event_id, topic, partition_key, key_hash, payload)
			SELECT gen_random_uuid(), 't', ($1::text[])[1 + i % $3], ($2::bigint[])[1 + i % $3], '\x00'::bytea FROM generate_series(0, $4 - 1) i`,
			keys, hashes, len(keys), n); err != nil {
			t.Fatal(err)
		}
	}
	theirs, theirHashes := keysIn(50, func(s int) bool { return s < 32 })
	insert(theirs, theirHashes, 20_000)
	if h := fnv32("blocked"); h%64 < 32 {
		t.Fatalf("key \"blocked\" is in shard %d, not one of this relay's", h%64)
	}
	insert([]string{"blocked"}, []int64{fnv32("blocked")}, 5_000)
	mine, myHashes := keysIn(50, func(s int) bool { return s >= 32 })
	insert(mine, myHashes, 20_000)
	if _, err := db.Pool.Exec(ctx, `ANALYZE `+db.Schema+`.outbox`); err != nil {
		t.Fatal(err)
	}

	remaining := func() (n int) {
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Schema+`.outbox`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for steps := 0; remaining() > 25_000; steps++ {
		if steps > 200 {
			t.Fatalf("not drained after %d steps: %d rows left", steps, remaining())
		}
		if err := r.leases.tick(ctx); err != nil { // keep the fence fresh
			t.Fatal(err)
		}
		if out := r.step(ctx); out.next == noShards || out.next == backOff {
			t.Fatalf("step %d: %+v", steps, out)
		}
	}
	// One more claim: it finds nothing and moves the cursor to the end.
	if out := r.step(ctx); out.rows != 0 {
		t.Fatalf("claim after the drain returned %d rows", out.rows)
	}

	snap, _, done, ok := r.leases.begin(ctx)
	if !ok {
		t.Fatal("no shards")
	}
	done()
	blocked := r.blocked.plan(time.Now())
	if len(blocked.keys) != 1 {
		t.Fatalf("blocked keys %v, want [blocked]", blocked.keys)
	}
	cursorCost := claimBuffers(t, db, r, snap, r.cur, blocked)
	fromStart := claimBuffers(t, db, r, snap, cursor{}, blocked)
	t.Logf("claim after the drain: %d buffers from the cursor, %d from the start of the table", cursorCost, fromStart)
	if cursorCost > 40 || cursorCost*20 > fromStart {
		t.Fatalf("claim from the cursor touches %d buffers (from the start: %d); want a few index pages", cursorCost, fromStart)
	}
}

// TestByteBudget: a claim stops adding rows at Config.MaxBatchBytes, so a batch of large rows
// holds a bounded number of them (a row larger than the budget still goes, alone), and every
// row is still published.
func TestByteBudget(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	sink := &ackSink{}
	r := steppedRelay(t, db, Config{Sink: sink, MaxBatchBytes: 100_000})
	// 50 rows of 30 kB, then one of 250 kB, then 10 more of 30 kB.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Schema+`.outbox (event_id, topic, key_hash, payload)
		SELECT gen_random_uuid(), 't', i, convert_to(repeat('x', CASE WHEN i = 50 THEN 250000 ELSE 30000 END), 'UTF8') FROM generate_series(0, 60) i`); err != nil {
		t.Fatal(err)
	}
	drainSteps(t, r)
	total := 0
	for _, n := range sink.calls {
		total += n
		if n > 100_000 && n != 250_000 {
			t.Fatalf("a batch carried %d payload bytes, over the 100,000 budget: %v", n, sink.calls)
		}
	}
	if total != 60*30_000+250_000 {
		t.Fatalf("published %d payload bytes in batches %v, want every row", total, sink.calls)
	}
}

// TestPrefetchSharesTheByteBudget: a claim sent while a batch is published (prefetch) takes
// only what that batch left of MaxBatchBytes, so the two batches the relay holds at once stay
// within one budget. Two rows per batch: two rows of 10 kB (a fifth of the budget), then rows
// of 45 kB, two of which fit a budget of their own but not what the first batch left.
func TestPrefetchSharesTheByteBudget(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	sink := &ackSink{}
	const budget = 100_000
	r := steppedRelay(t, db, Config{Sink: sink, BatchSize: 2, MaxBatchBytes: budget})
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Schema+`.outbox (event_id, topic, key_hash, payload)
		SELECT gen_random_uuid(), 't', i, convert_to(repeat('x', CASE WHEN i < 2 THEN 10000 ELSE 45000 END), 'UTF8') FROM generate_series(0, 9) i`); err != nil {
		t.Fatal(err)
	}
	drainSteps(t, r)
	total := 0
	for i, n := range sink.calls {
		total += n
		if i > 0 && sink.calls[i-1] <= budget/2 && sink.calls[i-1]+n > budget {
			t.Fatalf("batches of %d and %d payload bytes held at once, over the %d budget: %v", sink.calls[i-1], n, budget, sink.calls)
		}
	}
	if total != 2*10_000+8*45_000 {
		t.Fatalf("published %d payload bytes in batches %v, want every row", total, sink.calls)
	}
}

// TestClaimRoundTripIsOneTransaction: a claim's round trip (settings, the pending delete, the
// claim) runs as one transaction. The planner settings and the asynchronous commit apply to
// the claim and end with it (the pool's connection is left as it was); the claim does not see
// the rows deleted before it; and when the claim fails, the delete is rolled back with it.
func TestClaimRoundTripIsOneTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	cfg := db.Pool.Config().Copy()
	cfg.MaxConns = 1 // every statement below runs on the connection the claims used
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	r := steppedRelay(t, db, Config{Pool: pool, Sink: &ackSink{}})
	// A claim-shaped query whose header reports the settings it ran with.
	settings := `SELECT true, NULL::bigint, current_setting('enable_seqscan') || '/' || current_setting('synchronous_commit'), NULL::bigint, 0::bigint, NULL::timestamptz,
		0::bigint, '', '', '', 0::bigint, ''::bytea, '{}'::jsonb, 'epoch'::timestamptz, 0, 0::bigint`
	c, _, err := r.runClaim(ctx, claimNext, settings, nil, 10, pendingDelete{})
	if err != nil {
		t.Fatal(err)
	}
	if c.snap != "off/off" {
		t.Fatalf("the claim ran with enable_seqscan/synchronous_commit %s, want off/off", c.snap)
	}
	var after string
	if err := pool.QueryRow(ctx, `SELECT current_setting('enable_seqscan') || '/' || current_setting('synchronous_commit')`).Scan(&after); err != nil {
		t.Fatal(err)
	}
	if after != "on/on" {
		t.Fatalf("after the claim the connection has enable_seqscan/synchronous_commit %s, want on/on", after)
	}

	var ids []int64
	rows, err := pool.Query(ctx, `INSERT INTO `+db.Schema+`.outbox (event_id, topic, key_hash, payload)
		SELECT gen_random_uuid(), 't', i, '\x00'::bytea FROM generate_series(0, 2) i RETURNING id`)
	if err != nil {
		t.Fatal(err)
	}
	if ids, err = pgx.CollectRows(rows, pgx.RowTo[int64]); err != nil {
		t.Fatal(err)
	}
	slices.Sort(ids)
	count := func() (n int) {
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Schema+`.outbox`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	var server time.Time
	if err := pool.QueryRow(ctx, `SELECT pg_postmaster_start_time()`).Scan(&server); err != nil {
		t.Fatal(err)
	}
	del := pendingDelete{ids: ids[:1], server: server}
	if _, deleted, err := r.runClaim(ctx, claimNext, `SELECT 1/0`, nil, 10, del); err == nil || deleted {
		t.Fatalf("a failing claim returned err %v, deleted %v; want an error and no delete", err, deleted)
	}
	if n := count(); n != 3 {
		t.Fatalf("%d rows after a failed claim with a delete, want 3 (the delete rolled back)", n)
	}
	snap, _, done, ok := r.leases.begin(ctx)
	if !ok {
		t.Fatal("no shards")
	}
	done()
	sql, args := r.q.nextSQL(snap, r.cfg.Shards, cursor{}, blockedSet{}, 10, r.cfg.MaxBatchBytes)
	// A delete of rows claimed on another server (before a failover) deletes nothing here.
	if _, _, err := r.runClaim(ctx, claimNext, sql, args, 10, pendingDelete{ids: ids[:1], server: server.Add(-time.Second)}); err != nil {
		t.Fatal(err)
	}
	if n := count(); n != 3 {
		t.Fatalf("%d rows after a delete of rows claimed on another server, want 3 (nothing deleted)", n)
	}
	c, deleted, err := r.runClaim(ctx, claimNext, sql, args, 10, del)
	if err != nil || !deleted {
		t.Fatalf("claim with a delete: err %v, deleted %v", err, deleted)
	}
	if len(c.msgs) != 2 || c.msgs[0].ID != ids[1] || c.msgs[1].ID != ids[2] {
		t.Fatalf("the claim after deleting row %d returned %d rows, want rows %v", ids[0], len(c.msgs), ids[1:])
	}
	if n := count(); n != 2 {
		t.Fatalf("%d rows after the delete committed, want 2", n)
	}
}

// steppedRelay is a relay whose steps the test drives (r.step), holding every shard; cfg gets
// db's schema, a silent logger, and db's pool unless it has one.
func steppedRelay(t *testing.T, db *testdb.DB, cfg Config) *Relay {
	t.Helper()
	ctx := context.Background()
	if cfg.Pool == nil {
		cfg.Pool = db.Pool
	}
	cfg.Schema, cfg.Logger = db.Schema, slog.New(slog.DiscardHandler)
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.prepare(ctx); err != nil {
		t.Fatal(err)
	}
	if err := r.leases.tick(ctx); err != nil {
		t.Fatal(err)
	}
	return r
}

// drainSteps runs steps until one claims nothing (failing after 100), then deletes what is
// still pending.
func drainSteps(t *testing.T, r *Relay) {
	t.Helper()
	ctx := context.Background()
	for steps := 0; ; steps++ {
		if steps > 100 {
			t.Fatal("not drained after 100 steps")
		}
		if out := r.step(ctx); out.rows == 0 {
			break
		}
	}
	r.flushPending(ctx)
}
