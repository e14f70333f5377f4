package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/outbox"
)

// Relay moves committed outbox rows to a Sink: claim a batch in id order, publish it, delete
// exactly the rows the broker acknowledged. See the package documentation.
type Relay struct {
	cfg     Config
	pool    *pgxpool.Pool
	sink    Sink
	log     *slog.Logger
	m       Metrics
	q       *queries
	leases  *leases
	blocked *blockList
	wake    chan struct{}
	running atomic.Bool
	// idleFails counts consecutive batches that made no progress because of transient
	// errors; it drives the global backoff.
	idleFails int
}

// New validates cfg and returns a relay publishing the outbox of cfg.Schema through sink.
// pool must reach the database holding the migrated schema; the relay also opens one extra
// connection of its own (with the pool's settings) for LISTEN. New does not touch the
// database; Run does.
func New(pool *pgxpool.Pool, sink Sink, cfg Config) (*Relay, error) {
	cfg, err := cfg.withDefaults()
	var problems []error
	if err != nil {
		problems = append(problems, err)
	}
	if pool == nil {
		problems = append(problems, errors.New("relay: pool is nil"))
	}
	if sink == nil {
		problems = append(problems, errors.New("relay: sink is nil; use NewKafkaSink or NewPublisherSink"))
	}
	if err := errors.Join(problems...); err != nil {
		return nil, err
	}
	q := newQueries(cfg.Schema)
	r := &Relay{
		cfg:     cfg,
		pool:    pool,
		sink:    sink,
		log:     cfg.Logger.With("relay", cfg.InstanceID),
		m:       cfg.Metrics,
		q:       q,
		blocked: newBlockList(cfg.RetryBackoff, cfg.MaxRetryBackoff),
		wake:    make(chan struct{}, 1),
	}
	r.cfg.Logger = r.log
	r.leases = newLeases(r.cfg, pool, q, r.m)
	return r, nil
}

// Config returns the relay's configuration with defaults filled in.
func (r *Relay) Config() Config { return r.cfg }

// ErrShardCountMismatch is returned by Run when the lease table was set up with a different
// number of shards than Config.Shards, at start or because it was resharded while this relay
// was cut off from the database or paused (its leases had expired, so Reshard went ahead).
var ErrShardCountMismatch = errors.New("relay: shard count differs from the lease table")

// ErrNotMigrated is returned by Run when the schema lacks the relay's tables.
var ErrNotMigrated = errors.New("relay: schema is not migrated")

// Run publishes until ctx is cancelled, then lets the batch in flight finish (up to
// Config.ShutdownTimeout), releases its leases so other relays take over at once, and returns
// nil. It returns an error only when it cannot start (schema not migrated, shard count
// mismatch, already running) or when the lease table was resharded under it
// (ErrShardCountMismatch, after stopping as on cancellation). Database and broker failures
// while running are logged, counted and retried, never returned.
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("relay: Run called while already running")
	}
	defer r.running.Store(false)
	if err := r.prepare(ctx); err != nil {
		return err
	}
	bg, stopBg := context.WithCancel(context.WithoutCancel(ctx))
	// The lease goroutine stops the loop when the lease table no longer has our shard count.
	lctx, stopLoop := context.WithCancelCause(ctx)
	defer stopLoop(nil)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); r.leases.run(bg, stopLoop) }()
	if !r.cfg.DisableListen {
		wg.Add(1)
		go func() { defer wg.Done(); r.listen(bg) }()
	}
	if r.cfg.StatsInterval > 0 {
		if _, nop := r.m.(NopMetrics); !nop {
			wg.Add(1)
			go func() { defer wg.Done(); r.sampleStats(bg) }()
		}
	}
	r.log.Info("relay started", "schema", r.cfg.Schema, "shards", r.cfg.Shards, "batch_size", r.cfg.BatchSize,
		"poll_interval", r.cfg.PollInterval, "lease_duration", r.cfg.LeaseDuration)

	r.loop(lctx)

	stopBg()
	wg.Wait()
	r.leases.stop()
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := r.leases.releaseAll(rctx); err != nil {
		r.log.Warn("relay could not release its leases; other relays take over when they expire", "err", err, "within", r.cfg.FailoverBound())
	}
	if err := context.Cause(lctx); errors.Is(err, ErrShardCountMismatch) {
		r.log.Error("relay stopped: the lease table was resharded while it ran", "err", err)
		return err
	}
	r.log.Info("relay stopped")
	return nil
}

// Health reports whether the relay is running and renewing its leases; a non-nil error says
// what is wrong. Serve it on /healthz.
func (r *Relay) Health() error {
	if !r.running.Load() {
		return errors.New("relay: not running")
	}
	return r.leases.healthy()
}

func (r *Relay) prepare(ctx context.Context) error {
	var ok bool
	err := r.pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL AND to_regclass($2) IS NOT NULL AND to_regclass($3) IS NOT NULL`,
		r.q.outbox, r.q.lease, r.q.parked).Scan(&ok)
	if err != nil {
		return fmt.Errorf("relay: check schema %q: %w", r.cfg.Schema, err)
	}
	if !ok {
		return fmt.Errorf("%w: schema %q lacks the outbox or relay tables; run `onceflow migrate up --schema %s` (or migrations.Up) first", ErrNotMigrated, r.cfg.Schema, r.cfg.Schema)
	}
	return pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('onceflow.relay'), hashtext($1))`, r.cfg.Schema); err != nil {
			return fmt.Errorf("relay: lock lease table: %w", err)
		}
		n, maxShard, err := shardCount(ctx, tx, r.q)
		if err != nil {
			return err
		}
		if n == 0 {
			if _, err := tx.Exec(ctx, `INSERT INTO `+r.q.lease+` (shard) SELECT generate_series(0, $1::int - 1)`, r.cfg.Shards); err != nil {
				return fmt.Errorf("relay: create %d shard leases: %w", r.cfg.Shards, err)
			}
			r.log.Info("relay created the shard leases", "shards", r.cfg.Shards)
			return nil
		}
		if n != r.cfg.Shards || maxShard != n-1 {
			return shardMismatch(r.cfg, n)
		}
		return nil
	})
}

// shardMismatch is the error for a lease table holding n shards while cfg has another count.
func shardMismatch(cfg Config, n int) error {
	return fmt.Errorf("%w: the lease table in schema %q has %d shards, this relay is configured with %d. Every relay of a schema must use the same count: start it with --shards %d (Config.Shards), or stop every relay and change the count with `onceflow relay --reshard --shards %d` (relay.Reshard)",
		ErrShardCountMismatch, cfg.Schema, n, cfg.Shards, n, cfg.Shards)
}

func shardCount(ctx context.Context, tx pgx.Tx, q *queries) (n, maxShard int, err error) {
	if err := tx.QueryRow(ctx, `SELECT count(*), coalesce(max(shard), -1) FROM `+q.lease).Scan(&n, &maxShard); err != nil {
		return 0, 0, fmt.Errorf("relay: read shard leases: %w", err)
	}
	return n, maxShard, nil
}

// ReshardOptions configures Reshard.
type ReshardOptions struct {
	// Schema holds the relay tables. Default "onceflow".
	Schema string
	// Shards is the new shard count, 1 to MaxShards.
	Shards int
}

// Reshard changes the number of virtual shards. It refuses while any relay holds a live lease
// or heartbeat, because a running relay publishing with the old count could break per-key
// order; stop every relay (or wait for their leases to expire) first. Pending rows are simply
// reassigned: shard = key_hash % Shards.
func Reshard(ctx context.Context, pool *pgxpool.Pool, opts ReshardOptions) error {
	if opts.Schema == "" {
		opts.Schema = pgsql.DefaultSchema
	}
	var problems []error
	if err := pgsql.ValidateSchema(opts.Schema); err != nil {
		problems = append(problems, err)
	}
	if opts.Shards < 1 || opts.Shards > MaxShards {
		problems = append(problems, fmt.Errorf("shard count %d: use 1 to %d", opts.Shards, MaxShards))
	}
	if err := errors.Join(problems...); err != nil {
		return fmt.Errorf("relay: reshard: %w", err)
	}
	q := newQueries(opts.Schema)
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('onceflow.relay'), hashtext($1))`, opts.Schema); err != nil {
			return fmt.Errorf("relay: reshard: lock lease table: %w", err)
		}
		rows, err := tx.Query(ctx, `SELECT DISTINCT owner FROM `+q.lease+` WHERE owner <> '' AND expires_at > now()
			UNION SELECT id FROM `+q.member+` WHERE expires_at > now()`)
		if err != nil {
			return fmt.Errorf("relay: reshard: read leases: %w", err)
		}
		live, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return fmt.Errorf("relay: reshard: read leases: %w", err)
		}
		if len(live) > 0 {
			return fmt.Errorf("relay: reshard: relays %v are running (live lease or heartbeat); stop every relay of schema %q, or wait until their leases expire, then retry", live, opts.Schema)
		}
		if _, err := tx.Exec(ctx, `DELETE FROM `+q.lease); err != nil {
			return fmt.Errorf("relay: reshard: %w", err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+q.lease+` (shard) SELECT generate_series(0, $1::int - 1)`, opts.Shards); err != nil {
			return fmt.Errorf("relay: reshard: %w", err)
		}
		return nil
	})
}

// signal wakes the publishing loop (coalescing: one pending wake-up is enough).
func (r *Relay) signal() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// loop is the publishing loop: one batch at a time, in id order.
func (r *Relay) loop(ctx context.Context) {
	poll := time.NewTimer(r.cfg.PollInterval)
	defer poll.Stop()
	for ctx.Err() == nil {
		if shards, epochs := r.leases.takeReleases(); len(shards) > 0 {
			if err := r.leases.giveBack(ctx, shards, epochs); err != nil && ctx.Err() == nil {
				r.m.Failed(FailDatabase, 1)
				r.log.Warn("relay could not release shards; they expire on their own", "err", err)
			}
		}
		wait, next := r.step(ctx)
		switch next {
		case claimAgain:
			continue
		case backOff:
			// Something failed for everyone (broker or database): wait it out, ignoring
			// notifications, which would only hit the same failure sooner.
			poll.Reset(wait)
			select {
			case <-ctx.Done():
			case <-poll.C:
			}
			continue
		}
		if wait <= 0 || wait > r.cfg.PollInterval {
			wait = r.cfg.PollInterval
		}
		poll.Reset(wait)
		select {
		case <-ctx.Done():
		case <-r.wake:
		case <-r.leases.changed:
		case <-poll.C:
		}
		if !poll.Stop() {
			select {
			case <-poll.C:
			default:
			}
		}
	}
}

// What the loop does after a step.
type nextStep int

const (
	claimAgain nextStep = iota // the batch was full and made progress: claim the next one now
	idle                       // wait for a notification, a lease change, a blocked key's retry or the poll
	backOff                    // a global failure: wait the whole backoff
)

// step claims and publishes one batch and says what the loop does next, and for how long at
// most it waits.
func (r *Relay) step(ctx context.Context) (wait time.Duration, next nextStep) {
	snap, bctx, done, ok := r.leases.begin(context.WithoutCancel(ctx))
	if !ok {
		return r.cfg.PollInterval, idle
	}
	defer done()
	// On shutdown the batch in flight gets ShutdownTimeout to finish; lease loss cancels it at
	// once (through bctx).
	stop := context.AfterFunc(ctx, func() { time.AfterFunc(r.cfg.ShutdownTimeout, done) })
	defer stop()

	now := time.Now()
	keys, ids, retryAt := r.blocked.filter(now)
	sql, args := r.q.claimSQL(snap, r.cfg.Shards, keys, ids, r.cfg.BatchSize)
	t0 := time.Now()
	msgs, err := r.claim(bctx, sql, args)
	tClaim := time.Since(t0)
	if err != nil {
		if bctx.Err() != nil {
			return r.cfg.PollInterval, idle // lease lost or shutting down, not a database failure
		}
		r.m.Failed(FailDatabase, 1)
		r.log.Warn("relay claim failed; retrying", "err", err)
		return r.globalBackoff(), backOff
	}
	if !retryAt.IsZero() {
		wait = retryAt.Sub(now)
	}
	if len(msgs) == 0 {
		r.idleFails = 0
		return wait, idle
	}
	t1 := time.Now()
	res := r.publish(bctx, msgs)
	t2 := time.Now()
	r.finish(ctx, snap, msgs, res)
	if r.log.Enabled(ctx, slog.LevelDebug) {
		r.log.Debug("relay batch", "rows", len(msgs), "acked", len(res.ackedIDs), "failed", len(res.culprits)+res.transient,
			"claim", tClaim, "publish", t2.Sub(t1), "finish", time.Since(t2))
	}
	if len(res.ackedIDs) == 0 && len(res.parkedIDs) == 0 && res.transient > 0 {
		return r.globalBackoff(), backOff
	}
	r.idleFails = 0
	if len(msgs) == r.cfg.BatchSize {
		return 0, claimAgain
	}
	return wait, idle
}

func (r *Relay) globalBackoff() time.Duration {
	r.idleFails++
	return backoffDelay(r.cfg.RetryBackoff, r.cfg.MaxRetryBackoff, r.idleFails, rand.Float64())
}

func (r *Relay) claim(ctx context.Context, sql string, args []any) ([]*Message, error) {
	rows, err := r.pool.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	msgs := make([]*Message, 0, r.cfg.BatchSize)
	for rows.Next() {
		m := &Message{}
		var meta []byte
		if err = rows.Scan(&m.ID, &m.EventID, &m.Topic, &m.Key, &m.keyHash, &m.Payload, &meta, &m.CreatedAt, &m.Attempts); err != nil {
			return nil, err
		}
		m.blockKey = blockKeyOf(m.Key, m.ID)
		if m.Metadata, err = parseMetadata(meta); err != nil {
			// Not a JSON object of strings (the writer never stores that): refuse this row only.
			m.Metadata = nil
			m.badMetadata = fmt.Errorf("metadata of row %d is not a JSON object of strings: %w", m.ID, err)
		}
		msgs = append(msgs, m)
	}
	return msgs, rows.Err()
}

// finish records the batch's outcome in the database: acknowledged rows deleted, permanent
// failures counted and parked at the limit. It uses its own context: deleting acknowledged
// rows is worth finishing even when shutdown or a lost lease cancelled the batch.
func (r *Relay) finish(ctx context.Context, snap snapshot, msgs []*Message, res *result) {
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	now := time.Now()
	// Deleted before the next claim, never overlapped with it: a claim that skipped rows still
	// being deleted by an id range would also skip a row of the same key committed late inside
	// that range while taking the key's later rows, and reorder the key.
	if len(res.ackedIDs) > 0 {
		if err := r.deleteAcked(fctx, res.ackedIDs); err != nil {
			r.m.Failed(FailDatabase, 1)
			r.log.Warn("relay could not delete acknowledged rows; they will be published again (same event ids)", "rows", len(res.ackedIDs), "err", err)
		}
	}
	for _, m := range res.ackedMsgs {
		r.blocked.ok(m)
	}
	if len(res.culprits) > 0 {
		r.recordFailures(fctx, snap, res, now)
	}
	for _, m := range res.transientMsgs {
		r.blocked.fail(m, 0, now)
	}
}

// deleteAcked deletes acknowledged rows in one round trip. The commit does not wait for the
// WAL flush (synchronous_commit off for this transaction only): if the server crashes before
// the flush, the rows come back and are published again with the same event ids, which the
// contract allows, and every batch saves a disk flush.
func (r *Relay) deleteAcked(ctx context.Context, ids []int64) error {
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	b.Queue("SET LOCAL synchronous_commit TO OFF")
	b.Queue(r.q.deleteAcked, ids)
	b.Queue("COMMIT")
	return r.pool.SendBatch(ctx, b).Close()
}

// recordFailures counts permanent failures in outbox.attempts and parks rows that reached the
// limit, both only while this relay still holds the row's shard at the snapshot's epoch.
func (r *Relay) recordFailures(ctx context.Context, snap snapshot, res *result, now time.Time) {
	culprits := res.culprits
	var countIDs, parkIDs []int64
	var countErrs, parkErrs []string
	for _, c := range culprits {
		if c.msg.Attempts+1 >= r.cfg.MaxAttempts {
			parkIDs = append(parkIDs, c.msg.ID)
			parkErrs = append(parkErrs, errString(c.err))
		} else {
			countIDs = append(countIDs, c.msg.ID)
			countErrs = append(countErrs, errString(c.err))
		}
	}
	var parked []int64
	err := pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
		if len(countIDs) > 0 {
			if _, err := tx.Exec(ctx, r.q.countFailure, countIDs, r.cfg.Shards, r.cfg.InstanceID, snap.epochs, countErrs); err != nil {
				return fmt.Errorf("count failed attempts: %w", err)
			}
		}
		if len(parkIDs) > 0 {
			rows, err := tx.Query(ctx, r.q.park, parkIDs, r.cfg.Shards, r.cfg.InstanceID, snap.epochs, parkErrs)
			if err != nil {
				return fmt.Errorf("park rows: %w", err)
			}
			parked, err = pgx.CollectRows(rows, pgx.RowTo[int64])
			if err != nil {
				return fmt.Errorf("park rows: %w", err)
			}
		}
		return nil
	})
	if err != nil {
		r.m.Failed(FailDatabase, 1)
		r.log.Warn("relay could not record failed attempts; the rows are retried", "err", err)
		parked = nil
	}
	isParked := map[int64]bool{}
	for _, id := range parked {
		isParked[id] = true
	}
	for _, c := range culprits {
		if isParked[c.msg.ID] {
			// The chain moves on without it: later rows of the key are no longer held.
			r.blocked.ok(c.msg)
			r.log.Error("relay parked a row the broker keeps refusing; later rows of its key now flow (its order is broken by design); inspect with `onceflow outbox parked`, replay with `onceflow outbox replay`",
				"id", c.msg.ID, "event_id", c.msg.EventID, "topic", c.msg.Topic, "key", c.msg.Key, "attempts", c.msg.Attempts+1, "err", c.err)
			continue
		}
		d := r.blocked.fail(c.msg, c.msg.Attempts+1, now)
		r.log.Warn("relay: broker refused a row; its key waits and retries",
			"id", c.msg.ID, "event_id", c.msg.EventID, "topic", c.msg.Topic, "key", c.msg.Key,
			"attempt", c.msg.Attempts+1, "max_attempts", r.cfg.MaxAttempts, "retry_in", d.Round(time.Millisecond), "err", c.err)
	}
	if len(parked) > 0 {
		r.m.Parked(len(parked))
	}
	res.parkedIDs = parked
}

// sampleStats reports the pending rows and the age of the oldest every StatsInterval.
func (r *Relay) sampleStats(ctx context.Context) {
	t := time.NewTicker(r.cfg.StatsInterval)
	defer t.Stop()
	for {
		var rows int64
		var age float64
		qctx, cancel := context.WithTimeout(ctx, r.cfg.StatsInterval)
		err := r.pool.QueryRow(qctx, r.q.stats).Scan(&rows, &age)
		cancel()
		if err == nil {
			r.m.Pending(rows, time.Duration(age*float64(time.Second)))
		} else if ctx.Err() == nil {
			r.m.Failed(FailDatabase, 1)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// listenerCheck is how often an idle listener checks its connection.
const listenerCheck = 30 * time.Second

// listen holds a dedicated connection LISTENing on the outbox channel and wakes the loop on
// every notification. It reconnects with backoff when the connection drops, and wakes the loop
// after reconnecting because rows may have committed while nobody listened.
func (r *Relay) listen(ctx context.Context) {
	channel := pgx.Identifier{outbox.NotifyChannel(r.cfg.Schema)}.Sanitize()
	fails := 0
	for ctx.Err() == nil {
		err := func() error {
			conn, err := pgx.ConnectConfig(ctx, r.pool.Config().ConnConfig.Copy())
			if err != nil {
				return fmt.Errorf("connect: %w", err)
			}
			defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }() // nothing to do if closing fails
			if _, err := conn.Exec(ctx, "LISTEN "+channel); err != nil {
				return fmt.Errorf("LISTEN %s: %w", channel, err)
			}
			if fails > 0 {
				r.log.Info("relay listener reconnected", "channel", channel)
			}
			fails = 0
			r.signal()
			for {
				// Wake up now and then to check the connection: one that died without a reset
				// would otherwise leave the relay on the poll fallback until TCP gives up.
				wctx, cancel := context.WithTimeout(ctx, listenerCheck)
				_, err := conn.WaitForNotification(wctx)
				cancel()
				switch {
				case err == nil:
					r.signal()
				case ctx.Err() != nil:
					return ctx.Err()
				case errors.Is(err, context.DeadlineExceeded):
					pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
					err = conn.Ping(pctx)
					cancel()
					if err != nil {
						return fmt.Errorf("listener connection check: %w", err)
					}
				default:
					return err
				}
			}
		}()
		if ctx.Err() != nil {
			return
		}
		fails++
		d := backoffDelay(100*time.Millisecond, 5*time.Second, fails, rand.Float64())
		r.log.Warn("relay listener lost; polling every PollInterval until it reconnects", "err", err, "retry_in", d.Round(time.Millisecond))
		select {
		case <-ctx.Done():
			return
		case <-time.After(d):
		}
	}
}
