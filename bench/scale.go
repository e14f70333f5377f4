package main

// The scale scenarios: concurrent writers, drains of large backlogs, a relay whose rows lie
// behind another relay's, latency under load, the relay's memory on large payloads, and the
// inbox cleaner on millions of expired rows.

import (
	"context"
	"fmt"
	"hash/fnv"
	"maps"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// writeRounds is the number of rotating rounds of write_concurrent: 24, or BENCH_WRITE_ROUNDS.
// One round's ratios scatter by ±30 % even on a quiet machine (measured: onceflow ÷ plain
// INSERT 0.72–1.33 per round), so the 5 % the row's target resolves needs many: 6 rounds gave
// a median of 0.91 in two runs of one build where 30 rounds gave 1.00. 24 is four turns of the
// six variants' rotation (each variant as often in each position), about 2.5 min.
var writeRounds = func() int {
	if n, err := strconv.Atoi(os.Getenv("BENCH_WRITE_ROUNDS")); err == nil && n > 0 {
		return n
	}
	return 24
}()

// Sizes of the scale scenarios (drainGrowthBig may drop to 500,000 if the whole `make bench`
// must stay under five minutes on a slower machine: a claim whose cost grew with the backlog
// shows at 500k as it does at 1M).
const (
	writeWriters    = 16
	writeRoundTime  = time.Second
	drainGrowthBase = 200_000
	drainGrowthBig  = 1_000_000
	skipAhead       = 300_000
	skipOwn         = 100_000
	rssRows         = 2000
	rssPayload      = 900 << 10
	cleanupRows     = 2_000_000
)

func fnv32(key string) int64 {
	h := fnv.New32a()
	h.Write([]byte(key))
	return int64(h.Sum32())
}

// keysWhere returns n key names (keyName order) whose shard of 64 satisfies in.
func keysWhere(n int, in func(shard int) bool) []string {
	var keys []string
	for i := 0; len(keys) < n; i++ {
		if k := fmt.Sprintf("key-%d", i); in(int(fnv32(k) % 64)) {
			keys = append(keys, k)
		}
	}
	return keys
}

// fillOutbox inserts n outbox rows server-side (the relay cannot tell them from WriteTx rows:
// same columns, key hash, metadata with the partition key), round-robin over keys, in
// transactions of 100,000 rows.
func fillOutbox(ctx context.Context, pool interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, schema, topic string, keys []string, n int, payloadSQL string) error {
	hashes := make([]int64, len(keys))
	for i, k := range keys {
		hashes[i] = fnv32(k)
	}
	for off := 0; off < n; off += 100_000 {
		m := min(100_000, n-off)
		_, err := pool.Exec(ctx, `INSERT INTO `+pgsql.Table(schema, "outbox")+` (event_id, topic, partition_key, key_hash, payload, metadata)
			SELECT gen_random_uuid(), $1, ($2::text[])[1 + i % $4], ($3::bigint[])[1 + i % $4], `+payloadSQL+`,
				jsonb_build_object('partition_key', ($2::text[])[1 + i % $4])
			FROM generate_series($5::int, $5::int + $6::int - 1) i`, topic, keys, hashes, len(keys), off, m)
		if err != nil {
			return err
		}
	}
	return nil
}

// benchPayloadSQL is the bench payload as a SQL literal.
var benchPayloadSQL = `'\x` + fmt.Sprintf("%x", benchPayload) + `'::bytea`

// claimTracer records the duration of every claim a relay's pool runs.
type claimTracer struct {
	mu     sync.Mutex
	claims []timedClaim
}

type timedClaim struct {
	at   time.Time
	took time.Duration
}

type claimStart struct{}

// isClaim recognises the relay's cursor claim (relay/claim.go, nextSQL, whose first CTE is the
// late-commit lookup).
func isClaim(sql string) bool { return strings.HasPrefix(strings.TrimSpace(sql), "WITH late AS") }

// The relay pipelines a claim with its BEGIN READ ONLY, planner settings and COMMIT in one
// batch: a claim's duration is its batch's, one round trip, as the relay waits for it.
type batchMark struct {
	t0    time.Time
	claim bool
}

func (c *claimTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return context.WithValue(ctx, claimStart{}, &batchMark{t0: time.Now()})
}

func (c *claimTracer) TraceBatchQuery(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	if m, ok := ctx.Value(claimStart{}).(*batchMark); ok && isClaim(d.SQL) {
		m.claim = true
	}
}

func (c *claimTracer) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchEndData) {
	if m, ok := ctx.Value(claimStart{}).(*batchMark); ok && m.claim {
		c.record(m.t0)
	}
}

func (c *claimTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if isClaim(d.SQL) {
		return context.WithValue(ctx, claimStart{}, &batchMark{t0: time.Now(), claim: true})
	}
	return ctx
}

func (c *claimTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if m, ok := ctx.Value(claimStart{}).(*batchMark); ok && m.claim {
		c.record(m.t0)
	}
}

func (c *claimTracer) record(t0 time.Time) {
	c.mu.Lock()
	c.claims = append(c.claims, timedClaim{t0, time.Since(t0)})
	c.mu.Unlock()
}

// between returns the durations of claims started in [from, to).
func (c *claimTracer) between(from, to time.Time) []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []time.Duration
	for _, cl := range c.claims {
		if !cl.at.Before(from) && cl.at.Before(to) {
			out = append(out, cl.took)
		}
	}
	return out
}

// runRelay starts a relay with cfg (Pool, Schema, Sink and Logger filled in) and returns its stop.
func runRelay(ctx context.Context, e *env, pool *pgxpool.Pool, schema string, cfg relay.Config) (func(), error) {
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: e.brokers})
	if err != nil {
		return nil, err
	}
	cfg.Pool, cfg.Sink, cfg.Schema, cfg.Logger = pool, sink, schema, e.relayLog()
	r, err := relay.New(cfg)
	if err != nil {
		_ = sink.Close()
		return nil, err
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	return func() {
		cancel()
		if err := <-done; err != nil {
			e.log.Error("relay", "err", err)
		}
		_ = sink.Close()
	}, nil
}

// benchWriteConcurrent: 16 writers, each committing one business INSERT per transaction, on
// the durable cluster; the same plus one outbox event (outbox.WriteTx, default config); the
// plain INSERT and the outbox row (QueueWriteTx) sent in one round trip with the business
// INSERT, which is what each costs PostgreSQL without a round trip of its own; for
// reference, the same plus one plain INSERT of the outbox's columns into a table without any
// extra index, and the same with the write this library did before (a pg_notify in every
// transaction); and the outbox row with migration 0007's BRIN index on tx instead of the
// b-tree, and with no index on tx at all, each in an outbox of its own. No relay runs: this is the write path's cost. The variants alternate in 1 s
// rounds, in a rotating order; the ratio is the median over rounds of variant ÷ bare in the
// same round.
func benchWriteConcurrent(ctx context.Context, e *env) ([]result, error) {
	pool, schema, err := e.freshSchema(ctx, "wconc")
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	orders := pgsql.Table(schema, "bench_order")
	plain := pgsql.Table(schema, "bench_plain")
	if _, err := pool.Exec(ctx, `CREATE TABLE `+orders+` (id bigserial PRIMARY KEY, customer text NOT NULL, amount int NOT NULL)`); err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE `+plain+` (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, event_id uuid NOT NULL, topic text NOT NULL,
		partition_key text NOT NULL DEFAULT '', key_hash bigint NOT NULL, payload bytea NOT NULL, metadata jsonb NOT NULL DEFAULT '{}',
		created_at timestamptz NOT NULL DEFAULT now(), attempts int NOT NULL DEFAULT 0, last_error text)`); err != nil {
		return nil, err
	}
	w, err := outbox.NewWriter(outbox.Config{Schema: schema})
	if err != nil {
		return nil, err
	}
	// The alternatives for the late-commit bookkeeping, each an outbox of its own written by the
	// same writer: migration 0007's BRIN index on tx (never summarized here: no relay runs, the
	// best case for its writers), and no index on tx at all (what the b-tree costs).
	alt := func(name, index string) (*outbox.Writer, func(), error) {
		apool, aschema, err := e.freshSchema(ctx, name)
		if err != nil {
			return nil, nil, err
		}
		stmt := `DROP INDEX ` + pgsql.Table(aschema, "outbox_tx_idx")
		if index != "" {
			stmt += `; CREATE INDEX outbox_tx_brin ON ` + pgsql.Table(aschema, "outbox") + ` USING brin (((tx::text)::bigint)) WITH (pages_per_range = 32)`
		}
		if _, err := apool.Exec(ctx, stmt); err != nil {
			apool.Close()
			return nil, nil, err
		}
		aw, err := outbox.NewWriter(outbox.Config{Schema: aschema})
		if err != nil {
			apool.Close()
			return nil, nil, err
		}
		return aw, apool.Close, nil
	}
	wBRIN, closeBRIN, err := alt("wconc_brin", "brin")
	if err != nil {
		return nil, err
	}
	defer closeBRIN()
	wNone, closeNone, err := alt("wconc_notx", "")
	if err != nil {
		return nil, err
	}
	defer closeNone()
	before := `WITH ins AS (INSERT INTO ` + pgsql.Table(schema, "outbox") + ` (event_id, topic, partition_key, key_hash, payload, metadata)
		SELECT e, $1, k, h, p, m::jsonb FROM unnest($2::uuid[], $3::text[], $4::bigint[], $5::bytea[], $6::text[]) AS u(e, k, h, p, m) RETURNING 1),
		wake AS (SELECT pg_notify($7, '')) SELECT count(*) FROM ins, wake`
	channel := outbox.NotifyChannel(schema)
	// A variant runs op after the business INSERT, or, when it has queue, sends the business
	// INSERT and what queue adds in one round trip (tx.SendBatch).
	type variant struct {
		name  string
		op    func(tx pgx.Tx, i int) error
		queue func(b *pgx.Batch, i int) error
	}
	business := `INSERT INTO ` + orders + ` (customer, amount) VALUES ($1, $2)`
	plainInsert := `INSERT INTO ` + plain + ` (event_id, topic, partition_key, key_hash, payload, metadata) VALUES ($1, $2, $3, $4, $5, $6::jsonb)`
	plainArgs := func(i int) []any {
		return []any{uuid.Must(uuid.NewV7()).String(), "bench", keyName(i % 50), fnv32(keyName(i % 50)), benchPayload, `{"partition_key":"` + keyName(i%50) + `"}`}
	}
	variants := []variant{
		{name: "bare", op: func(pgx.Tx, int) error { return nil }},
		{name: "bare+insert", op: func(tx pgx.Tx, i int) error {
			_, err := tx.Exec(ctx, plainInsert, plainArgs(i)...)
			return err
		}},
		{name: "notify-every-write", op: func(tx pgx.Tx, i int) error {
			var n int
			return tx.QueryRow(ctx, before, "bench", []string{uuid.Must(uuid.NewV7()).String()}, []string{keyName(i % 50)}, []int64{fnv32(keyName(i % 50))},
				[][]byte{benchPayload}, []string{`{"partition_key":"` + keyName(i%50) + `"}`}, channel).Scan(&n)
		}},
		{name: "onceflow", op: func(tx pgx.Tx, i int) error {
			return w.WriteTx(ctx, tx, "bench", outbox.SetPartitionKey(outbox.NewMessage(benchPayload), keyName(i%50)))
		}},
		{name: "outbox-0007-brin", op: func(tx pgx.Tx, i int) error {
			return wBRIN.WriteTx(ctx, tx, "bench", outbox.SetPartitionKey(outbox.NewMessage(benchPayload), keyName(i%50)))
		}},
		{name: "outbox-no-tx-index", op: func(tx pgx.Tx, i int) error {
			return wNone.WriteTx(ctx, tx, "bench", outbox.SetPartitionKey(outbox.NewMessage(benchPayload), keyName(i%50)))
		}},
		// The same two writes sent with the business INSERT in one round trip: what a plain
		// INSERT and the outbox row cost PostgreSQL without a round trip of their own.
		{name: "bare+insert-pipelined", queue: func(b *pgx.Batch, i int) error {
			b.Queue(plainInsert, plainArgs(i)...)
			return nil
		}},
		{name: "onceflow-queued", queue: func(b *pgx.Batch, i int) error {
			return w.QueueWriteTx(ctx, b, "bench", outbox.SetPartitionKey(outbox.NewMessage(benchPayload), keyName(i%50)))
		}},
	}
	rates := map[string][]float64{}
	for round := range writeRounds {
		// Rotate the order, so no variant always runs right after the same other one.
		for k := range variants {
			v := variants[(k+round)%len(variants)]
			var n atomic.Int64
			stop := time.Now().Add(writeRoundTime)
			var wg sync.WaitGroup
			errc := make(chan error, writeWriters)
			for g := range writeWriters {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := g; time.Now().Before(stop); i += writeWriters {
						err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
							if v.queue != nil {
								b := &pgx.Batch{}
								b.Queue(business, "c-1029384756", 8997)
								if err := v.queue(b, i); err != nil {
									return err
								}
								return tx.SendBatch(ctx, b).Close()
							}
							if _, err := tx.Exec(ctx, business, "c-1029384756", 8997); err != nil {
								return err
							}
							return v.op(tx, i)
						})
						if err != nil {
							errc <- fmt.Errorf("%s: %w", v.name, err)
							return
						}
						n.Add(1)
					}
				}()
			}
			wg.Wait()
			close(errc)
			if err := <-errc; err != nil {
				return nil, err
			}
			rates[v.name] = append(rates[v.name], float64(n.Load())/writeRoundTime.Seconds())
		}
	}
	var out []result
	for _, v := range variants {
		var ratios []float64
		for i, r := range rates[v.name] {
			ratios = append(ratios, r/rates["bare"][i])
		}
		res := result{Scenario: "write_concurrent", System: v.name, Value: median(rates[v.name]), Unit: "tx/s", HigherIsBetter: true}
		if v.name != "bare" {
			res.Versus = fmt.Sprintf("%.2f× bare", median(ratios))
		}
		if v.name == "onceflow" {
			res.Target = "≥ 0.70× bare"
			out = append(out, result{Scenario: "write_concurrent_ratio", System: "onceflow", Value: median(ratios), Unit: "×", Target: "≥ 0.70"})
			var vsPlain []float64
			for i, r := range rates[v.name] {
				vsPlain = append(vsPlain, r/rates["bare+insert"][i])
			}
			out = append(out, result{Scenario: "write_concurrent_ratio", System: "onceflow-vs-plain-insert", Value: median(vsPlain), Unit: "×", Versus: "-", Target: "≥ 0.95"})
		}
		if v.name == "onceflow-queued" {
			var vsPlain []float64
			for i, r := range rates[v.name] {
				vsPlain = append(vsPlain, r/rates["bare+insert-pipelined"][i])
			}
			out = append(out, result{Scenario: "write_concurrent_ratio", System: "onceflow-queued-vs-plain-pipelined", Value: median(vsPlain), Unit: "×", Versus: "-"})
		}
		fmt.Fprintf(os.Stderr, "  write_concurrent %-18s %v tx/s, ratios %.2f\n", v.name, roundAll(rates[v.name]), ratios)
		out = append(out, res)
	}
	// The late-commit bookkeeping's cost to writers, paired per round: the b-tree (onceflow)
	// against 0007's BRIN and against no index on tx.
	for _, alt := range []string{"outbox-0007-brin", "outbox-no-tx-index"} {
		var r []float64
		for i, x := range rates["onceflow"] {
			r = append(r, x/rates[alt][i])
		}
		fmt.Fprintf(os.Stderr, "  write_concurrent onceflow ÷ %s per round: %.2f (median %.2f)\n", alt, r, median(r))
		out = append(out, result{Scenario: "write_concurrent_ratio", System: "onceflow-vs-" + alt, Value: median(r), Unit: "×", Versus: "-"})
	}
	// Ratio row last, so the table reads tx/s first.
	slices.SortStableFunc(out, func(a, b result) int { return strings.Compare(a.Scenario, b.Scenario) })
	return out, nil
}

// benchDrainGrowth: one relay runs throughout; 200,000 rows appear at once (one transaction
// committed with the relay running, after a checkpoint), then 1,000,000, then 200,000 again right after, in one
// schema with autovacuum off for the outbox (the worst case: autovacuum does not run during
// a drain, and here not between them either, so the later claims run over every row deleted
// before). Each drain is timed from the commit to the consumer holding every event. Then the
// duration of the idle relay's claims on the drained, unvacuumed outbox, and of the first
// claim of a relay started on it (it walks the deleted rows once).
func benchDrainGrowth(ctx context.Context, e *env) ([]result, error) {
	pool, schema, err := e.freshSchema(ctx, "growth")
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `ALTER TABLE `+pgsql.Table(schema, "outbox")+` SET (autovacuum_enabled = false)`); err != nil {
		return nil, err
	}
	tracer := &claimTracer{}
	rcfg := pool.Config().Copy()
	rcfg.ConnConfig.Tracer = tracer
	rpool, err := pgxpool.NewWithConfig(ctx, rcfg)
	if err != nil {
		return nil, err
	}
	defer rpool.Close()
	stop, err := runRelay(ctx, e, rpool, schema, relay.Config{InstanceID: "growth"})
	if err != nil {
		return nil, err
	}
	defer func() { stop() }()
	keys := keysWhere(50, func(int) bool { return true })
	drain := func(n int) (float64, time.Time, error) {
		topic := benchTopic(fmt.Sprintf("growth-%d", n))
		rcv, err := newReceiver(ctx, e.brokers, topic)
		if err != nil {
			return 0, time.Time{}, err
		}
		defer rcv.stop()
		tx, err := pool.Begin(ctx)
		if err != nil {
			return 0, time.Time{}, err
		}
		defer func() { _ = tx.Rollback(ctx) }()
		if err := fillOutbox(ctx, tx, schema, topic, keys, n, benchPayloadSQL); err != nil {
			return 0, time.Time{}, err
		}
		// A checkpoint before the rows commit, so every drain deletes rows written before the
		// last checkpoint and pays the same full-page images per page (as the rows of any backlog
		// that built up over minutes do: checkpoint_timeout is 5 min). Left to chance, the
		// checkpoint that the fill's WAL requests lands in some drains and not others: measured,
		// 11 MiB of WAL for a 200k drain before it, 341 MiB for the 1M drain after it (not 55),
		// which moved the 1M ÷ 200k ratio by up to 0.1 whatever the claims cost.
		if _, err := pool.Exec(ctx, `CHECKPOINT`); err != nil {
			fmt.Fprintf(os.Stderr, "  drain_growth: no CHECKPOINT before the drain (%v): its figure depends on when the server checkpoints\n", err)
		}
		// Server-side rows do not go through the writer: wake the relay as it would.
		if _, err := tx.Exec(ctx, `SELECT pg_notify($1, '')`, outbox.NotifyChannel(schema)); err != nil {
			return 0, time.Time{}, err
		}
		if err := tx.Commit(ctx); err != nil {
			return 0, time.Time{}, err
		}
		start := time.Now()
		before, _ := serverWork(ctx, pool)
		if err := rcv.waitFor(ctx, n, 10*time.Minute); err != nil {
			return 0, time.Time{}, err
		}
		done := time.Now()
		if after, err := serverWork(ctx, pool); err == nil {
			fmt.Fprintf(os.Stderr, "  drain_growth %d rows: server during the drain: %s\n", n, after.since(before))
		}
		// The relay's claims during this drain: a claim whose cost grew with the backlog or
		// with the dead rows of an earlier drain shows here, whatever else the machine does.
		claims := tracer.between(start, done)
		var p50, p99 time.Duration
		if len(claims) > 0 {
			p50, p99 = percentile(claims, 50), percentile(claims, 99)
		}
		fmt.Fprintf(os.Stderr, "  drain_growth %d rows in %s; %d claims, p50 %.2f ms, p99 %.2f ms\n",
			n, done.Sub(start).Round(time.Millisecond), len(claims), ms(p50), ms(p99))
		// Idle: the relay polls tightly for 200 ms after the last rows, then sleeps.
		time.Sleep(300 * time.Millisecond)
		return float64(n) / done.Sub(start).Seconds(), done, nil
	}
	first, _, err := drain(drainGrowthBase)
	if err != nil {
		return nil, err
	}
	big, _, err := drain(drainGrowthBig)
	if err != nil {
		return nil, err
	}
	after, done, err := drain(drainGrowthBase)
	if err != nil {
		return nil, err
	}
	idle := tracer.between(done.Add(20*time.Millisecond), done.Add(300*time.Millisecond))
	if len(idle) == 0 {
		tracer.mu.Lock()
		n := len(tracer.claims)
		var lastAt time.Time
		if n > 0 {
			lastAt = tracer.claims[n-1].at
		}
		tracer.mu.Unlock()
		return nil, fmt.Errorf("no idle claims observed (%d claims traced, the last %s after the drain)", n, lastAt.Sub(done))
	}
	idleMs := make([]float64, len(idle))
	for i, d := range idle {
		idleMs[i] = ms(d)
	}
	fmt.Fprintf(os.Stderr, "  drain_growth idle claims on the drained outbox: n=%d median %.3f ms max %.3f ms\n", len(idle), median(idleMs), slices.Max(idleMs))
	// A relay started on the drained outbox: its first claim walks the deleted rows once.
	stop()
	restarted := time.Now()
	stop, err = runRelay(ctx, e, rpool, schema, relay.Config{InstanceID: "growth-2"})
	if err != nil {
		return nil, err
	}
	time.Sleep(time.Second)
	var restartMs []float64
	for _, d := range tracer.between(restarted, time.Now()) {
		restartMs = append(restartMs, ms(d))
	}
	if len(restartMs) > 0 {
		fmt.Fprintf(os.Stderr, "  drain_growth first claim of a relay started on the drained outbox: %.1f ms, then median %.3f ms\n", restartMs[0], median(restartMs[1:]))
	}
	bigName := fmt.Sprintf("%dk", drainGrowthBig/1000)
	if drainGrowthBig%1_000_000 == 0 {
		bigName = fmt.Sprintf("%dM", drainGrowthBig/1_000_000)
	}
	return []result{
		{Scenario: "drain_growth", System: "onceflow-200k", Value: first, Unit: "ev/s", Versus: "-"},
		{Scenario: "drain_growth", System: "onceflow-" + bigName, Value: big, Unit: "ev/s", Versus: fmt.Sprintf("%.2f× 200k", big/first), Target: "≥ 0.85× 200k"},
		{Scenario: "drain_growth", System: "onceflow-200k-after", Value: after, Unit: "ev/s", Versus: fmt.Sprintf("%.2f× first 200k", after/first), Target: "≥ 0.85× first"},
		{Scenario: "drain_growth_ratio", System: bigName + "-vs-200k", Value: big / first, Unit: "×", Versus: "-", Target: "≥ 0.85"},
		{Scenario: "drain_growth_ratio", System: "after-vs-first", Value: after / first, Unit: "×", Versus: "-", Target: "≥ 0.85"},
		{Scenario: "idle_claim", System: "onceflow", Value: median(idleMs), Unit: "ms", Target: "≤ 1 ms"},
	}, nil
}

// benchRelaySkip: one relay owns half the shards (a live member "other" holds the rest and
// publishes nothing); 100,000 rows of its shards are written behind 300,000 rows of the other
// shards. Its drain rate is compared with the same 100,000 rows without the others ahead.
func benchRelaySkip(ctx context.Context, e *env) ([]result, error) {
	mine := keysWhere(50, func(s int) bool { return s >= 32 })
	theirs := keysWhere(50, func(s int) bool { return s < 32 })
	run := func(ahead int) (float64, error) {
		pool, schema, err := e.freshSchema(ctx, "skip")
		if err != nil {
			return 0, err
		}
		defer pool.Close()
		if _, err := pool.Exec(ctx, `INSERT INTO `+pgsql.Table(schema, "relay_lease")+` (shard, owner, epoch, expires_at)
			SELECT s, CASE WHEN s < 32 THEN 'other' ELSE '' END, 1, CASE WHEN s < 32 THEN now() + interval '1 hour' ELSE 'epoch' END FROM generate_series(0, 63) s`); err != nil {
			return 0, err
		}
		if _, err := pool.Exec(ctx, `INSERT INTO `+pgsql.Table(schema, "relay_member")+` (id, expires_at) VALUES ('other', now() + interval '1 hour')`); err != nil {
			return 0, err
		}
		topic := benchTopic("skip")
		if ahead > 0 {
			if err := fillOutbox(ctx, pool, schema, benchTopic("skip-other"), theirs, ahead, benchPayloadSQL); err != nil {
				return 0, err
			}
		}
		if err := fillOutbox(ctx, pool, schema, topic, mine, skipOwn, benchPayloadSQL); err != nil {
			return 0, err
		}
		rcv, err := newReceiver(ctx, e.brokers, topic)
		if err != nil {
			return 0, err
		}
		defer rcv.stop()
		start := time.Now()
		stop, err := runRelay(ctx, e, pool, schema, relay.Config{InstanceID: "me"})
		if err != nil {
			return 0, err
		}
		defer stop()
		if err := rcv.waitFor(ctx, skipOwn, 10*time.Minute); err != nil {
			return 0, err
		}
		took := time.Since(start)
		fmt.Fprintf(os.Stderr, "  relay_skip %d own rows behind %d others in %s\n", skipOwn, ahead, took.Round(time.Millisecond))
		return float64(skipOwn) / took.Seconds(), nil
	}
	alone, err := run(0)
	if err != nil {
		return nil, err
	}
	behind, err := run(skipAhead)
	if err != nil {
		return nil, err
	}
	return []result{
		{Scenario: "relay_skip", System: "alone", Value: alone, Unit: "ev/s", HigherIsBetter: true},
		{Scenario: "relay_skip", System: "onceflow", Value: behind, Unit: "ev/s", HigherIsBetter: true, Versus: fmt.Sprintf("%.2f× alone", behind/alone), Target: "≥ 0.5× alone"},
	}, nil
}

// benchLatencyLoad: commit → consumer receipt at 2,000 events/s, one event per transaction,
// from 16 writers, for 20 s; onceflow with its defaults. 20 s, not 5: at 2,000 events/s the
// p99 of 5 s is the 100th-slowest event, which one or two stalls of the machine decide
// (measured on the 2-core VM: 3.7–8.7 ms in three 5 s runs in a row); 20 s gives 400. The figures are the steady state: the
// events of the first 0.25 s are left out (the writers' 16 connections being opened — backends
// forking on the same 2 cores — and the relay waking from its sleep after the warm-up event:
// the `latency` and `stall` rows measure waking). latency_load_p99_all keeps them.
func benchLatencyLoad(ctx context.Context, e *env) ([]result, error) {
	sys, err := newOnceflowSystem(ctx, e, "latload")
	if err != nil {
		return nil, err
	}
	defer sys.close()
	const rate, seconds = 2000, 20
	const settle = rate / 4
	stopTrace, stopProfile := maybeTrace("latency_load"), maybeProfile("latency_load")
	stopBackground := sampleBackground(ctx, sys.pool)
	work, _ := serverWork(ctx, sys.pool)
	all, err := measureLatency(ctx, e, sys, "onceflow", settle+rate*seconds, rate, 50, 16)
	fmt.Fprintf(os.Stderr, "  latency_load: %s\n", stopBackground())
	if after, werr := serverWork(ctx, sys.pool); werr == nil {
		fmt.Fprintf(os.Stderr, "  latency_load: the server did %s\n", after.since(work))
	}
	stopProfile()
	stopTrace()
	if err != nil {
		return nil, err
	}
	lat := all[settle:] // in commit order
	p50, p99 := percentile(lat, 50), percentile(lat, 99)
	fmt.Fprintf(os.Stderr, "  latency_load onceflow n=%d p50=%s p99=%s max=%s; with the first 0.25 s: p99=%s max=%s\n",
		len(lat), p50, p99, slices.Max(lat), percentile(all, 99), slices.Max(all))
	return []result{
		{Scenario: "latency_load_p50", System: "onceflow", Value: ms(p50), Unit: "ms"},
		{Scenario: "latency_load_p99", System: "onceflow", Value: ms(p99), Unit: "ms", Target: "≤ 5 ms"},
		{Scenario: "latency_load_p99_all", System: "onceflow", Value: ms(percentile(all, 99)), Unit: "ms"},
	}, nil
}

// benchInboxCleanup: the inbox cleaner deleting 2,000,000 expired dedup rows (with 10,000 young
// ones that stay), once with synchronized sequential scans and once without (what a server
// with large shared_buffers effectively has); each batch's duration is traced. A third run
// models a saga participant's table (sync scans on): half of the expired rows are barrier
// rows of 1,000,000 sagas (one each), 5,000 of them still alive, whose rows the cleaner
// keeps; participant ÷ sync-scans-on is the cost of looking their sagas up.
func benchInboxCleanup(ctx context.Context, e *env) ([]result, error) {
	var out []result
	totals := map[string]time.Duration{}
	for _, label := range []string{"sync-scans-on", "sync-scans-off", "participant"} {
		syncScans, participant := label != "sync-scans-off", label == "participant"
		pool, schema, err := e.freshSchema(ctx, "cleanup")
		if err != nil {
			return nil, err
		}
		table := pgsql.Table(schema, "processed_event")
		// In the participant run, every odd row is the barrier row of saga s<(g+1)/2>.
		sagaOf := "NULL"
		if participant {
			sagaOf = "CASE WHEN g % 2 = 1 THEN 's' || ((g + 1) / 2) END"
		}
		for off := 0; off < cleanupRows; off += 500_000 {
			if _, err := pool.Exec(ctx, `INSERT INTO `+table+` (consumer, dedup_key, processed_at, saga_id)
				SELECT 'bench', 'k-' || g, now() - interval '100 hours' + g * interval '100 microseconds', `+sagaOf+` FROM generate_series($1::int + 1, $1::int + 500000) g`, off); err != nil {
				pool.Close()
				return nil, err
			}
		}
		kept := 0
		if participant {
			if _, err := pool.Exec(ctx, `INSERT INTO `+pgsql.Table(schema, "saga")+` (id, name, version, state, data, steps, finished_at)
				SELECT 's' || g, 'bench', 1, CASE WHEN g <= 5000 THEN 'running' ELSE 'completed' END, '{}', '[]',
				CASE WHEN g <= 5000 THEN NULL ELSE now() END FROM generate_series(1, $1::int) g`, cleanupRows/2); err != nil {
				pool.Close()
				return nil, err
			}
			kept = 5000 // the barrier rows of the live sagas s1…s5000: rows 1, 3, …, 9,999
		}
		if _, err := pool.Exec(ctx, `INSERT INTO `+table+` (consumer, dedup_key) SELECT 'bench', 'young-' || g FROM generate_series(1, 10000) g`); err != nil {
			pool.Close()
			return nil, err
		}
		if _, err := pool.Exec(ctx, `VACUUM ANALYZE `+table); err != nil {
			pool.Close()
			return nil, err
		}
		tr := &deleteTracer{}
		ccfg := pool.Config().Copy()
		ccfg.ConnConfig.Tracer = tr
		ccfg.ConnConfig.RuntimeParams["synchronize_seqscans"] = map[bool]string{true: "on", false: "off"}[syncScans]
		if participant {
			if _, err := pool.Exec(ctx, `VACUUM ANALYZE `+pgsql.Table(schema, "saga")); err != nil {
				pool.Close()
				return nil, err
			}
		}
		cpool, err := pgxpool.NewWithConfig(ctx, ccfg)
		if err != nil {
			pool.Close()
			return nil, err
		}
		c, err := inbox.NewCleaner(inbox.CleanerConfig{Pool: cpool, Schema: schema, Logger: e.log})
		if err != nil {
			cpool.Close()
			pool.Close()
			return nil, err
		}
		start := time.Now()
		n, err := c.Clean(ctx)
		took := time.Since(start)
		cpool.Close()
		pool.Close()
		if err != nil {
			return nil, err
		}
		if n != int64(cleanupRows-kept) {
			return nil, fmt.Errorf("cleaner deleted %d rows, want %d", n, cleanupRows-kept)
		}
		b := tr.durations()
		tenth := max(1, len(b)/10)
		firstMean, lastMean := meanMs(b[:tenth]), meanMs(b[len(b)-tenth:])
		totals[label] = took
		fmt.Fprintf(os.Stderr, "  inbox_cleanup %s: %d rows in %s, %d batches, mean first tenth %.2f ms, last tenth %.2f ms, last batch %.2f ms\n",
			label, n, took.Round(time.Millisecond), len(b), firstMean, lastMean, ms(b[len(b)-1]))
		out = append(out,
			result{Scenario: "inbox_cleanup", System: label, Value: took.Seconds(), Unit: "s", Versus: "-"},
			result{Scenario: "inbox_cleanup_batch_growth", System: label, Value: lastMean / firstMean, Unit: "×", Versus: fmt.Sprintf("%.2f → %.2f ms", firstMean, lastMean), Target: "≤ 2"})
	}
	out = append(out,
		result{Scenario: "inbox_cleanup_off_vs_on", System: "onceflow", Value: totals["sync-scans-off"].Seconds() / totals["sync-scans-on"].Seconds(), Unit: "×", Versus: "-", Target: "≤ 1.5"},
		result{Scenario: "inbox_cleanup_participant_vs_on", System: "onceflow", Value: totals["participant"].Seconds() / totals["sync-scans-on"].Seconds(), Unit: "×",
			Versus: "half barrier rows, 5k live sagas kept", Target: "≤ 1.5"})
	return out, nil
}

// deleteTracer records the duration of every DELETE statement.
type deleteTracer struct {
	mu sync.Mutex
	d  []time.Duration
}

type deleteStart struct{}

func (t *deleteTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.HasPrefix(d.SQL, "DELETE") {
		return context.WithValue(ctx, deleteStart{}, time.Now())
	}
	return ctx
}

func (t *deleteTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if t0, ok := ctx.Value(deleteStart{}).(time.Time); ok {
		t.mu.Lock()
		t.d = append(t.d, time.Since(t0))
		t.mu.Unlock()
	}
}

func (t *deleteTracer) durations() []time.Duration {
	t.mu.Lock()
	defer t.mu.Unlock()
	return slices.Clone(t.d)
}

func meanMs(ds []time.Duration) float64 {
	var sum time.Duration
	for _, d := range ds {
		sum += d
	}
	return ms(sum) / float64(len(ds))
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	sort.Float64s(s)
	if len(s) == 0 {
		return 0
	}
	return s[len(s)/2]
}

func roundAll(xs []float64) []int {
	out := make([]int, len(xs))
	for i, x := range xs {
		out[i] = int(x + 0.5)
	}
	return out
}

// serverCounters is the cluster's cumulative work: checkpoints and WAL. A checkpoint that lands
// in one drain and not another changes its rate (the full-page images after it), whatever the
// relay does, so drain_growth prints what happened during each drain.
type serverCounters struct {
	timed, requested, buffersBackend int64
	walBytes                         float64
}

func serverWork(ctx context.Context, pool *pgxpool.Pool) (serverCounters, error) {
	var c serverCounters
	err := pool.QueryRow(ctx, `SELECT checkpoints_timed, checkpoints_req, buffers_backend,
		pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8 FROM pg_stat_bgwriter`).Scan(&c.timed, &c.requested, &c.buffersBackend, &c.walBytes)
	return c, err
}

func (c serverCounters) since(b serverCounters) string {
	return fmt.Sprintf("%d checkpoints (%d requested), %.0f MiB WAL, %d buffers written by backends",
		c.timed+c.requested-b.timed-b.requested, c.requested-b.requested, (c.walBytes-b.walBytes)/(1<<20), c.buffersBackend-b.buffersBackend)
}

// sampleBackground looks every 100 ms for vacuums running on the server (autovacuum or not)
// and for a checkpoint being written, until the returned function is called, which says in
// how many samples each was seen (and which tables were vacuumed): both share the machine's two
// cores and its disk with what a scenario measures.
func sampleBackground(ctx context.Context, pool *pgxpool.Pool) (stop func() string) {
	done := make(chan struct{})
	var samples, vacuuming, checkpointing int
	tables := map[string]bool{}
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			rows, err := pool.Query(ctx, `SELECT coalesce(n.nspname || '.' || c.relname, p.relid::text) FROM pg_stat_progress_vacuum p
				LEFT JOIN pg_class c ON c.oid = p.relid LEFT JOIN pg_namespace n ON n.oid = c.relnamespace`)
			if err != nil {
				continue
			}
			names, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				continue
			}
			// The checkpointer waits on CheckpointerMain between checkpoints; any other wait
			// (CheckpointWriteDelay, DataFileSync, …) or none (running) is a checkpoint in
			// progress. (Its wait event shows to superusers and pg_read_all_stats only.)
			var idle bool
			if err := pool.QueryRow(ctx, `SELECT coalesce(bool_and(wait_event IS NOT DISTINCT FROM 'CheckpointerMain'), true) FROM pg_stat_activity
				WHERE backend_type = 'checkpointer'`).Scan(&idle); err != nil {
				continue
			}
			samples++
			if len(names) > 0 {
				vacuuming++
			}
			if !idle {
				checkpointing++
			}
			for _, n := range names {
				tables[n] = true
			}
		}
	}()
	return func() string {
		close(done)
		<-finished
		return fmt.Sprintf("a vacuum ran in %d of %d samples (every 100 ms), on %v; a checkpoint was being written in %d",
			vacuuming, samples, slices.Sorted(maps.Keys(tables)), checkpointing)
	}
}
