package main

// The scheduled-message scenarios (outbox.DeliverAt / DeliverAfter, migration 0021): what a
// large table of rows due later costs the relay's immediate traffic (scheduled_backlog), how
// late a due message is published (scheduled_latency), and what a burst of due rows costs the
// scheduler, during and after its move (scheduled_burst).

import (
	"context"
	"fmt"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

const (
	schedBacklogRows   = 1_000_000 // scheduled a day ahead
	schedBacklogDrain  = 200_000   // immediate rows per drain
	schedBacklogRounds = 4         // concurrent drains (even: each commit order as often)
	schedLatencyRate   = 1000      // due per second
	schedLatencySecs   = 20
	schedBurstRows     = 1_000_000 // due at once
)

// fillScheduled inserts n rows into outbox_scheduled server-side, round-robin over keys, as
// outbox.DeliverAt writes them (same columns, key hash, metadata with the partition key),
// in statements of 100,000 rows (each its own transaction, unless pool is one). dueSQL is the
// due time of row i (an SQL expression of i).
func fillScheduled(ctx context.Context, pool interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, schema, topic string, keys []string, n int, dueSQL string) error {
	hashes := make([]int64, len(keys))
	for i, k := range keys {
		hashes[i] = fnv32(k)
	}
	for off := 0; off < n; off += 100_000 {
		m := min(100_000, n-off)
		_, err := pool.Exec(ctx, `INSERT INTO `+pgsql.Table(schema, "outbox_scheduled")+` (event_id, topic, partition_key, key_hash, payload, metadata, due_at)
			SELECT gen_random_uuid(), $1, ($2::text[])[1 + i % $4], ($3::bigint[])[1 + i % $4], `+benchPayloadSQL+`,
				jsonb_build_object('partition_key', ($2::text[])[1 + i % $4]), `+dueSQL+`
			FROM generate_series($5::int, $5::int + $6::int - 1) i`, topic, keys, hashes, len(keys), off, m)
		if err != nil {
			return err
		}
	}
	return nil
}

// isMove recognises the scheduler's move of due rows (relay/scheduled.go, scheduledMoveSQL).
func isMove(sql string) bool {
	return strings.HasPrefix(strings.TrimSpace(sql), "WITH lock AS (SELECT pg_try_advisory_xact_lock")
}

type moveStart struct{}

// schedTracer records the relay's claims (claimTracer) and, apart, its scheduler's moves.
type schedTracer struct {
	*claimTracer
	moves *claimTracer
}

func newSchedTracer() *schedTracer {
	return &schedTracer{claimTracer: &claimTracer{}, moves: &claimTracer{}}
}

func (s *schedTracer) TraceQueryStart(ctx context.Context, c *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if isMove(d.SQL) {
		return context.WithValue(ctx, moveStart{}, time.Now())
	}
	return s.claimTracer.TraceQueryStart(ctx, c, d)
}

func (s *schedTracer) TraceQueryEnd(ctx context.Context, c *pgx.Conn, d pgx.TraceQueryEndData) {
	if t0, ok := ctx.Value(moveStart{}).(time.Time); ok {
		s.moves.record(t0)
		return
	}
	s.claimTracer.TraceQueryEnd(ctx, c, d)
}

// tracedPool is a second pool on pool's schema whose statements tr sees (the relay's pool).
func tracedPool(ctx context.Context, pool *pgxpool.Pool, tr *schedTracer) (*pgxpool.Pool, error) {
	cfg := pool.Config().Copy()
	cfg.ConnConfig.Tracer = tr
	return pgxpool.NewWithConfig(ctx, cfg)
}

// benchScheduledBacklog: the immediate rows' drain with 1,000,000 rows scheduled a day ahead
// (due over the hour after, vacuumed and analysed as a table that filled over a day would be)
// against the same drain in a schema without them, both at once, each with its relay (defaults):
// 200,000 rows (50 keys) committed in each schema together, then the figure is how many each
// relay had delivered to the consumer when the first of them had all its rows: the ratio of
// their rates over the same window, which the machine's drift (±30 % between drains on two
// shared cores) cannot skew, as it would two drains one after the other. Four rounds, the
// two commits in alternating order (the side committed second came out ahead by up to 0.1 in
// A/A runs, both sides without scheduled rows: 1.08, 0.90, 1.13); the figure is the geometric
// mean of the rounds' ratios (target ≥ 0.9). Beside it the relays' claims during the drains and their
// schedulers' checks (the move statement: one probe of outbox_scheduled_due_idx, and the next
// due time) over the scenario.
func benchScheduledBacklog(ctx context.Context, e *env) ([]result, error) {
	keys := keysWhere(50, func(int) bool { return true })
	type side struct {
		name   string
		pool   *pgxpool.Pool
		rpool  *pgxpool.Pool
		schema string
		tr     *schedTracer
		stop   func()
		counts []float64 // delivered when the round's first side was done
		claims []time.Duration
	}
	var sides [2]*side
	defer func() {
		for _, s := range sides {
			if s == nil {
				continue
			}
			if s.stop != nil {
				s.stop()
			}
			if s.rpool != nil {
				s.rpool.Close()
			}
			s.pool.Close()
		}
	}()
	for i, name := range []string{"none", "1M"} {
		pool, schema, err := e.freshSchema(ctx, "schedbl")
		if err != nil {
			return nil, err
		}
		s := &side{name: name, pool: pool, schema: schema, tr: newSchedTracer()}
		sides[i] = s
		if name == "1M" {
			t0 := time.Now()
			if err := fillScheduled(ctx, pool, schema, benchTopic("schedbl-later"), keys, schedBacklogRows,
				`now() + interval '1 day' + i * interval '3.6 ms'`); err != nil {
				return nil, err
			}
			if _, err := pool.Exec(ctx, `VACUUM ANALYZE `+pgsql.Table(schema, "outbox_scheduled")); err != nil {
				return nil, err
			}
			fmt.Fprintf(os.Stderr, "  scheduled_backlog: %d rows scheduled a day ahead in %s\n", schedBacklogRows, time.Since(t0).Round(time.Millisecond))
		}
		if s.rpool, err = tracedPool(ctx, pool, s.tr); err != nil {
			return nil, err
		}
		if s.stop, err = runRelay(ctx, e, s.rpool, schema, relay.Config{InstanceID: "schedbl-" + name}); err != nil {
			return nil, err
		}
	}
	time.Sleep(time.Second) // both relays hold their shards
	round := func() error {
		var rcvs [2]*receiver
		var txs [2]pgx.Tx
		defer func() {
			for i := range sides {
				if rcvs[i] != nil {
					rcvs[i].stop()
				}
				if txs[i] != nil {
					_ = txs[i].Rollback(ctx)
				}
			}
		}()
		for i, s := range sides {
			topic := benchTopic("schedbl-" + s.name)
			var err error
			if rcvs[i], err = newReceiver(ctx, e.brokers, topic); err != nil {
				return err
			}
			if txs[i], err = s.pool.Begin(ctx); err != nil {
				return err
			}
			if err := fillOutbox(ctx, txs[i], s.schema, topic, keys, schedBacklogDrain, benchPayloadSQL); err != nil {
				return err
			}
			if _, err := txs[i].Exec(ctx, `SELECT pg_notify($1, '')`, outbox.NotifyChannel(s.schema)); err != nil {
				return err
			}
		}
		// As drain_growth: a checkpoint first, so both drains pay the page images of rows
		// written before the last checkpoint.
		if _, err := sides[0].pool.Exec(ctx, `CHECKPOINT`); err != nil {
			fmt.Fprintf(os.Stderr, "  scheduled_backlog: no CHECKPOINT before the drain (%v)\n", err)
		}
		// Committed together, the second first in every other round.
		order := []int{0, 1}
		if len(sides[0].counts)%2 == 1 {
			order = []int{1, 0}
		}
		for _, i := range order {
			if err := txs[i].Commit(ctx); err != nil {
				return err
			}
		}
		start := time.Now()
		deadline := start.Add(10 * time.Minute)
		for rcvs[0].count() < schedBacklogDrain && rcvs[1].count() < schedBacklogDrain {
			if time.Now().After(deadline) {
				return fmt.Errorf("drains not done within 10 min: %d and %d of %d", rcvs[0].count(), rcvs[1].count(), schedBacklogDrain)
			}
			time.Sleep(5 * time.Millisecond)
		}
		done := time.Now()
		for i, s := range sides {
			s.counts = append(s.counts, float64(rcvs[i].count()))
			s.claims = append(s.claims, s.tr.between(start, done)...)
		}
		fmt.Fprintf(os.Stderr, "  scheduled_backlog round %d: after %s, none %d, 1M %d of %d delivered (%.0f and %.0f ev/s)\n",
			len(sides[0].counts), done.Sub(start).Round(time.Millisecond), rcvs[0].count(), rcvs[1].count(), schedBacklogDrain,
			float64(rcvs[0].count())/done.Sub(start).Seconds(), float64(rcvs[1].count())/done.Sub(start).Seconds())
		// Let both finish (not measured), then sleep.
		for i := range sides {
			if err := rcvs[i].waitFor(ctx, schedBacklogDrain, 10*time.Minute); err != nil {
				return err
			}
		}
		time.Sleep(300 * time.Millisecond)
		return nil
	}
	var ratios []float64
	for r := range schedBacklogRounds {
		if err := round(); err != nil {
			return nil, err
		}
		ratios = append(ratios, sides[1].counts[r]/sides[0].counts[r])
	}
	none, big := sides[0], sides[1]
	// Every check of the schedulers over the scenario (while a relay sleeps, one per 4.5 s;
	// while it is awake, one per ScheduledCheckInterval).
	checksNone, checksBig := none.tr.moves.between(time.Time{}, time.Now()), big.tr.moves.between(time.Time{}, time.Now())
	ratio := geomean(ratios)
	claimNone, claimBig := ms(percentile(none.claims, 50)), ms(percentile(big.claims, 50))
	fmt.Fprintf(os.Stderr, "  scheduled_backlog: ratios %.2f; claims p50 %.2f / %.2f ms; scheduler checks: none n=%d p50 %.3f ms, 1M n=%d p50 %.3f ms\n",
		ratios, claimNone, claimBig, len(checksNone), ms(percentileOr0(checksNone, 50)), len(checksBig), ms(percentileOr0(checksBig, 50)))
	return []result{
		{Scenario: "scheduled_backlog", System: "onceflow", Value: ratio, Unit: "× without", HigherIsBetter: true,
			Versus: fmt.Sprintf("rounds %s", fmtRatios(ratios)), Target: "≥ 0.9"},
		{Scenario: "scheduled_backlog_claim_p50", System: "no-scheduled", Value: claimNone, Unit: "ms"},
		{Scenario: "scheduled_backlog_claim_p50", System: "onceflow", Value: claimBig, Unit: "ms", Versus: fmt.Sprintf("%.2f× without", claimBig/claimNone)},
		{Scenario: "scheduled_check_p50", System: "no-scheduled", Value: ms(percentileOr0(checksNone, 50)), Unit: "ms"},
		{Scenario: "scheduled_check_p50", System: "onceflow", Value: ms(percentileOr0(checksBig, 50)), Unit: "ms",
			Versus: fmt.Sprintf("%.2f× without", ms(percentileOr0(checksBig, 50))/ms(percentileOr0(checksNone, 50)))},
	}, nil
}

func geomean(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	sum := 0.0
	for _, x := range xs {
		sum += math.Log(x)
	}
	return math.Exp(sum / float64(len(xs)))
}

func fmtRatios(xs []float64) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = fmt.Sprintf("%.2f", x)
	}
	return strings.Join(parts, ", ")
}

func percentileOr0(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	return percentile(ds, p)
}

// stampReceiver keeps each event's first record timestamp (the relay's produce time).
type stampReceiver struct {
	mu     sync.Mutex
	at     map[uuid.UUID]time.Time
	cancel context.CancelFunc
	done   chan struct{}
}

func newStampReceiver(ctx context.Context, brokers []string, topic string) (*stampReceiver, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(100*time.Millisecond),
		kgo.MetadataMinAge(100*time.Millisecond), kgo.AllowAutoTopicCreation())
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	r := &stampReceiver{at: map[uuid.UUID]time.Time{}, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		defer cl.Close()
		for ctx.Err() == nil {
			fs := cl.PollFetches(ctx)
			r.mu.Lock()
			fs.EachRecord(func(rec *kgo.Record) {
				for _, h := range rec.Headers {
					if h.Key != relaykafka.UUIDHeader {
						continue
					}
					if id, err := uuid.ParseBytes(h.Value); err == nil {
						if _, dup := r.at[id]; !dup {
							r.at[id] = rec.Timestamp
						}
					}
				}
			})
			r.mu.Unlock()
		}
	}()
	return r, nil
}

func (r *stampReceiver) stop() { r.cancel(); <-r.done }

func (r *stampReceiver) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.at)
}

func (r *stampReceiver) when(id string) (time.Time, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	t, ok := r.at[uuid.MustParse(id)]
	return t, ok
}

func (r *stampReceiver) waitFor(ctx context.Context, n int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for r.count() < n {
		if time.Now().After(deadline) {
			return fmt.Errorf("received %d of %d events within %s", r.count(), n, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	return nil
}

// benchScheduledLatency: 20,000 messages scheduled with outbox.DeliverAt, due one every
// millisecond (1,000 due/s) for 20 s over 50 keys, written in advance (20 transactions of
// 1,000); one relay with its defaults, nothing else written. Figure: due → published, the
// Kafka record's timestamp (the relay's producer clock, the bench's clock) minus the due time;
// p50 and p99 over the 20 s. Beside it, how often the scheduler ran its move statement.
func benchScheduledLatency(ctx context.Context, e *env) ([]result, error) {
	pool, schema, err := e.freshSchema(ctx, "schedlat")
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	tr := newSchedTracer()
	rpool, err := tracedPool(ctx, pool, tr)
	if err != nil {
		return nil, err
	}
	defer rpool.Close()
	w, err := outbox.NewWriter(outbox.Config{Schema: schema})
	if err != nil {
		return nil, err
	}
	topic := benchTopic("schedlat")
	rcv, err := newStampReceiver(ctx, e.brokers, topic)
	if err != nil {
		return nil, err
	}
	defer rcv.stop()
	stop, err := runRelay(ctx, e, rpool, schema, relay.Config{InstanceID: "schedlat"})
	if err != nil {
		return nil, err
	}
	defer stop()
	write := func(msgs []*message.Message) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return w.WriteTx(ctx, tx, topic, msgs...) })
	}
	// Warm up: the topic exists, producer and consumer know it.
	if err := write(keyedMessages(0, 1, 1)); err != nil {
		return nil, err
	}
	if err := rcv.waitFor(ctx, 1, time.Minute); err != nil {
		return nil, fmt.Errorf("warm-up: %w", err)
	}
	total := schedLatencyRate * schedLatencySecs
	t0 := time.Now().Add(2 * time.Second)
	due := make([]time.Time, total)
	ids := make([]string, total)
	msgs := keyedMessages(0, total, 50)
	for i, m := range msgs {
		due[i] = t0.Add(time.Duration(i) * time.Second / schedLatencyRate)
		outbox.DeliverAt(m, due[i])
		ids[i] = m.UUID
	}
	for i := 0; i < total; i += 1000 {
		if err := write(msgs[i : i+1000]); err != nil {
			return nil, err
		}
	}
	if late := time.Since(t0); late > 0 {
		return nil, fmt.Errorf("the scheduled messages were written %s after the first was due; the machine is too slow for this scenario", late)
	}
	stopProfile := maybeProfile("scheduled_latency")
	time.Sleep(time.Until(due[total-1]))
	if err := rcv.waitFor(ctx, total+1, time.Minute); err != nil {
		return nil, err
	}
	stopProfile()
	lat := make([]time.Duration, total)
	for i, id := range ids {
		at, _ := rcv.when(id)
		lat[i] = at.Sub(due[i].Truncate(time.Millisecond)) // record timestamps are milliseconds
	}
	early := 0
	for _, l := range lat {
		if l < 0 {
			early++
		}
	}
	if early > 0 {
		return nil, fmt.Errorf("%d scheduled messages published before their time", early)
	}
	moves := tr.moves.between(t0, due[total-1].Add(time.Second))
	seconds := due[total-1].Add(time.Second).Sub(t0).Seconds()
	early2, late2 := tr.moves.between(t0, t0.Add(2*time.Second)), tr.moves.between(due[total-1].Add(-2*time.Second), due[total-1])
	fmt.Fprintf(os.Stderr, "  scheduled_latency: moves in the first 2 s median %.2f ms, in the last 2 s %.2f ms\n", ms(percentileOr0(early2, 50)), ms(percentileOr0(late2, 50)))
	p50, p99 := percentile(lat, 50), percentile(lat, 99)
	fmt.Fprintf(os.Stderr, "  scheduled_latency n=%d p50=%s p99=%s max=%s; the scheduler ran %d moves (%.0f/s, median %.2f ms, p99 %.2f ms)\n",
		total, p50, p99, slices.Max(lat), len(moves), float64(len(moves))/seconds, ms(percentileOr0(moves, 50)), ms(percentileOr0(moves, 99)))
	return []result{
		{Scenario: "scheduled_latency_p50", System: "onceflow", Value: ms(p50), Unit: "ms"},
		{Scenario: "scheduled_latency_p99", System: "onceflow", Value: ms(p99), Unit: "ms", Target: "≤ 1000 ms"},
		{Scenario: "scheduled_latency_moves", System: "onceflow", Value: float64(len(moves)) / seconds, Unit: "moves/s", Versus: "-"},
	}, nil
}

// benchScheduledBurst: 1,000,000 rows scheduled in the past (all due at once, as after a
// relay outage of an hour), committed while a relay with its defaults runs: how fast the
// scheduler moves them (and the relay publishes them), and what the next due probe costs
// afterwards, while the moved rows' dead entries are still in outbox_scheduled_due_idx, and
// after a VACUUM. The probe is the move's scan (due rows, in due order, locked, skipping
// locked ones) run in a transaction rolled back; median of 20, with the buffers it read.
func benchScheduledBurst(ctx context.Context, e *env) ([]result, error) {
	pool, schema, err := e.freshSchema(ctx, "schedburst")
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	// Autovacuum off on the table: the worst case, and the same for every probe below.
	sched := pgsql.Table(schema, "outbox_scheduled")
	if _, err := pool.Exec(ctx, `ALTER TABLE `+sched+` SET (autovacuum_enabled = false)`); err != nil {
		return nil, err
	}
	keys := keysWhere(50, func(int) bool { return true })
	topic := benchTopic("schedburst")
	probe := func(what string) (float64, error) {
		var took []float64
		var plan string
		for i := range 21 {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return 0, err
			}
			t0 := time.Now()
			q := `SELECT event_id FROM ` + sched + ` WHERE due_at <= now() ORDER BY due_at, seq LIMIT 1000 FOR UPDATE SKIP LOCKED`
			if i == 0 {
				rows, err := tx.Query(ctx, `EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) `+q)
				if err == nil {
					var lines []string
					lines, err = pgx.CollectRows(rows, pgx.RowTo[string])
					plan = strings.Join(lines, " | ")
				}
				if err != nil {
					_ = tx.Rollback(ctx)
					return 0, err
				}
			} else {
				if _, err := tx.Exec(ctx, q); err != nil {
					_ = tx.Rollback(ctx)
					return 0, err
				}
				took = append(took, ms(time.Since(t0)))
			}
			if err := tx.Rollback(ctx); err != nil {
				return 0, err
			}
		}
		fmt.Fprintf(os.Stderr, "  scheduled_burst probe %s: median %.3f ms; %s\n", what, median(took), plan)
		return median(took), nil
	}
	// A few rows due tomorrow, so the table is never empty (as in production).
	if err := fillScheduled(ctx, pool, schema, topic, keys, 1000, `now() + interval '1 day' + i * interval '1 s'`); err != nil {
		return nil, err
	}
	before, err := probe("before the burst")
	if err != nil {
		return nil, err
	}
	tr := newSchedTracer()
	rpool, err := tracedPool(ctx, pool, tr)
	if err != nil {
		return nil, err
	}
	defer rpool.Close()
	stop, err := runRelay(ctx, e, rpool, schema, relay.Config{InstanceID: "schedburst"})
	if err != nil {
		return nil, err
	}
	stopped := false
	defer func() {
		if !stopped {
			stop()
		}
	}()
	// Due an hour ago, committed at once (one transaction).
	fillStart := time.Now()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return fillScheduled(ctx, tx, schema, topic, keys, schedBurstRows, `now() - interval '1 hour' + i * interval '1 microsecond'`)
	}); err != nil {
		return nil, err
	}
	committed := time.Now()
	fmt.Fprintf(os.Stderr, "  scheduled_burst: %d rows due an hour ago committed in %s\n", schedBurstRows, committed.Sub(fillStart).Round(time.Millisecond))
	var moved, drained time.Time
	for {
		var left, pending bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+sched+` WHERE due_at <= now()),
			EXISTS (SELECT 1 FROM `+pgsql.Table(schema, "outbox")+`)`).Scan(&left, &pending); err != nil {
			return nil, err
		}
		if !left && moved.IsZero() {
			moved = time.Now()
		}
		if !left && !pending {
			drained = time.Now()
			break
		}
		if time.Since(committed) > 10*time.Minute {
			return nil, fmt.Errorf("the burst was not moved and published within 10 min")
		}
		time.Sleep(50 * time.Millisecond)
	}
	moveS, drainS := moved.Sub(committed).Seconds(), drained.Sub(committed).Seconds()
	burstMoves := tr.moves.between(committed, moved)
	// Each move of 1,000 rows leaves 1,000 dead entries at the head of the due index, which
	// the next move's scan walks again: the first moves against the last.
	firstMs, lastMs := 0.0, 0.0
	if n := len(burstMoves); n >= 100 {
		firstMs, lastMs = ms(percentile(burstMoves[:50], 50)), ms(percentile(burstMoves[n-50:], 50))
	}
	fmt.Fprintf(os.Stderr, "  scheduled_burst: moved in %.1f s (%.0f rows/s, %d moves, median %.1f ms, p99 %.1f ms; first 50 moves median %.1f ms, last 50 %.1f ms), published in %.1f s\n",
		moveS, float64(schedBurstRows)/moveS, len(burstMoves), ms(percentileOr0(burstMoves, 50)), ms(percentileOr0(burstMoves, 99)), firstMs, lastMs, drainS)
	stop()
	stopped = true
	after, err := probe("after the burst (dead index entries)")
	if err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, `VACUUM `+sched); err != nil {
		return nil, err
	}
	vacuumed, err := probe("after VACUUM")
	if err != nil {
		return nil, err
	}
	return []result{
		{Scenario: "scheduled_burst_move", System: "onceflow", Value: float64(schedBurstRows) / moveS, Unit: "rows/s", HigherIsBetter: true, Versus: "-"},
		{Scenario: "scheduled_burst_publish", System: "onceflow", Value: float64(schedBurstRows) / drainS, Unit: "ev/s", HigherIsBetter: true, Versus: "-"},
		{Scenario: "scheduled_burst_move_ms", System: "first-50", Value: firstMs, Unit: "ms"},
		{Scenario: "scheduled_burst_move_ms", System: "onceflow", Value: lastMs, Unit: "ms", Versus: fmt.Sprintf("last 50: %.1f× the first", lastMs/firstMs)},
		{Scenario: "scheduled_probe", System: "before", Value: before, Unit: "ms"},
		{Scenario: "scheduled_probe", System: "onceflow", Value: after, Unit: "ms", Versus: fmt.Sprintf("%.0f× before, %.0f× vacuumed", after/before, after/vacuumed)},
		{Scenario: "scheduled_probe", System: "vacuumed", Value: vacuumed, Unit: "ms", Versus: "-"},
	}, nil
}
