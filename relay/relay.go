package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/tracing"
	"github.com/onceflow/onceflow/migrations"
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
	// schedWake wakes the scheduler (a notification: a row due soon may have been written);
	// asleepSince is when the loop marked the relay asleep (UnixNano; 0 while awake).
	schedWake   chan struct{}
	asleepSince atomic.Int64
	running     atomic.Bool
	// idleFails counts consecutive batches that made no progress because of transient
	// errors; it drives the global backoff.
	idleFails int

	// The publishing loop's own state (only the loop goroutine touches it).
	cur         cursor    // where the next claim starts
	server      time.Time // start time of the server the last claim ran on (serverChanged)
	retriedLast bool      // the last claim was a retry claim: the next one claims from the cursor
	lastRows    time.Time // when a claim last returned rows
	backoff     time.Duration
	asleep      bool // marked asleep in relay_member: writers notify on commit
	sleptAt     time.Time
	pending     pendingDelete // acknowledged rows not deleted yet: the next claim deletes them
	prefetched  *prefetch     // the next claim, sent while a batch is published (prefetch.go)
	// listening is true while the listener connection is LISTENing.
	listening atomic.Bool
	tr        *tracing.Tracer // send spans (trace.go)
	flog      *failureLog     // publish failures, summed up (failurelog.go)
	topics    *topicGate      // topics the broker refused as a whole (topicgate.go)
}

// New validates cfg, reporting every problem at once (*ConfigError), and returns a relay
// publishing the outbox of cfg.Schema from cfg.Pool through cfg.Sink. New does not touch the
// database; Run does.
func New(cfg Config) (*Relay, error) {
	cfg, err := cfg.withDefaults()
	var problems []error
	var ce *ConfigError
	if errors.As(err, &ce) {
		problems = append(problems, ce.Problems...)
	} else if err != nil {
		problems = append(problems, err)
	}
	if cfg.Pool == nil {
		problems = append(problems, errors.New("Pool is nil; pass the *pgxpool.Pool of the database holding the outbox"))
	}
	if cfg.Sink == nil {
		problems = append(problems, errors.New("Sink is nil; use relaykafka.NewSink or relay.NewPublisherSink"))
	}
	if len(problems) > 0 {
		return nil, &ConfigError{Scope: "relay", Problems: problems}
	}
	pool, sink := cfg.Pool, cfg.Sink
	q := newQueries(cfg.Schema)
	r := &Relay{
		cfg:       cfg,
		pool:      pool,
		sink:      sink,
		log:       cfg.Logger.With("relay", cfg.InstanceID),
		m:         cfg.Metrics,
		q:         q,
		blocked:   newBlockList(cfg.RetryBackoff, cfg.MaxRetryBackoff),
		wake:      make(chan struct{}, 1),
		schedWake: make(chan struct{}, 1),
		tr:        tracing.New(cfg.TracerProvider, cfg.Propagator),
		flog:      newFailureLog(cfg.Logger, cfg.FailureLogInterval),
		topics:    newTopicGate(cfg.RetryBackoff, cfg.MaxRetryBackoff),
	}
	r.cfg.Logger = r.log
	r.leases = newLeases(r.cfg, pool, q, r.m)
	return r, nil
}

// Config returns the relay's configuration with defaults filled in.
func (r *Relay) Config() Config { return r.cfg }

// ErrNotMigrated is matched (errors.Is) by Run's error when the schema lacks migration steps
// this binary needs; the error lists them and names the command to run. It is
// migrations.ErrNotMigrated.
var ErrNotMigrated = migrations.ErrNotMigrated

// Run publishes until ctx is cancelled, then lets the batch in flight finish (up to
// Config.ShutdownTimeout), releases its leases so other relays take over at once, and returns
// nil. When PostgreSQL cannot be reached at start it waits for it, with backoff, logging what
// it waits for. It returns an error only when it cannot start for a reason waiting does not
// fix (schema not migrated, shard count mismatch, refused credentials, another live relay with
// the same id: ErrInstanceIDInUse, already running) or when the lease table was resharded
// under it or another process took its id over (ErrShardCountMismatch, ErrInstanceIDInUse,
// after stopping as on cancellation). Database and broker failures while running are logged, counted and retried,
// never returned.
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("relay: Run called while already running")
	}
	defer r.running.Store(false)
	if err := r.prepareWaiting(ctx); err != nil {
		return err
	}
	if ctx.Err() != nil {
		return nil // stopped while waiting for the database
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
	wg.Add(1)
	go func() { defer wg.Done(); r.scheduler(bg) }()
	if r.cfg.StatsInterval > 0 {
		if _, nop := r.m.(NopMetrics); !nop {
			wg.Add(1)
			go func() { defer wg.Done(); r.sampleStats(bg) }()
		}
	}
	r.log.Info("relay started", "schema", r.cfg.Schema, "shards", r.cfg.Shards, "batch_size", r.cfg.BatchSize,
		"max_batch_bytes", r.cfg.MaxBatchBytes, "poll_interval", r.cfg.PollInterval, "busy_poll_interval", r.cfg.BusyPollInterval,
		"lease_duration", r.cfg.LeaseDuration)

	r.loop(lctx)

	stopBg()
	wg.Wait()
	r.leases.stop()
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := r.leases.releaseAll(rctx); err != nil {
		r.log.Warn("relay could not release its leases; other relays take over when they expire", "err", err, "within", r.cfg.FailoverBound())
	}
	switch err := context.Cause(lctx); {
	case errors.Is(err, ErrShardCountMismatch):
		r.log.Error("relay stopped: the lease table was resharded while it ran", "err", err)
		return err
	case errors.Is(err, ErrInstanceIDInUse):
		r.log.Error("relay stopped: another process took over its id", "err", err)
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

// prepareWaiting runs prepare until it succeeds, fails for a reason waiting cannot fix, or ctx
// ends. A relay started while PostgreSQL is down or restarting (a rolling restart, a database
// that comes up after the relay) waits for it, with backoff, instead of exiting into a
// supervisor's crash loop; /healthz (Health) reports it unhealthy meanwhile.
func (r *Relay) prepareWaiting(ctx context.Context) error {
	for attempt := 1; ; attempt++ {
		err := r.prepare(ctx)
		if err == nil || ctx.Err() != nil {
			return nil
		}
		if !waitable(err) {
			return err
		}
		d := backoffDelay(r.cfg.RetryBackoff, r.cfg.MaxRetryBackoff, attempt, rand.Float64())
		r.log.Warn("relay waiting for PostgreSQL before starting", "attempt", attempt, "retry_in", d.Round(time.Millisecond), "err", err)
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
	}
}

// waitable reports whether a start-up failure may go away by itself: the server is
// unreachable, restarting, shutting down or out of connections. A schema that is not migrated,
// a shard-count mismatch, a refused password, a missing database or privilege is reported at
// once: it needs a person.
func waitable(err error) bool {
	if errors.Is(err, migrations.ErrNotMigrated) || errors.Is(err, ErrShardCountMismatch) || errors.Is(err, ErrInstanceIDInUse) {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return strings.HasPrefix(pgErr.Code, "08") || // connection exception
			strings.HasPrefix(pgErr.Code, "57P") || // admin shutdown, crash shutdown, cannot connect now
			pgErr.Code == "53300" || // too many connections
			pgErr.Code == "40001" || pgErr.Code == "40P01" // serialization failure, deadlock
	}
	return true // no answer from a server: refused, reset, timed out, name not resolved
}

func (r *Relay) prepare(ctx context.Context) error {
	// Every step this binary knows must be applied, not just the relay's tables: a later step
	// may change a column the claim reads. The error lists what is missing and what to run.
	if err := migrations.Validate(ctx, r.pool, migrations.Options{Schema: r.cfg.Schema, Logger: r.log}); err != nil {
		return fmt.Errorf("relay: %w", err)
	}
	r.findSequence(ctx)
	err := pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
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
	if err != nil {
		return err
	}
	return r.leases.join(ctx)
}

// findSequence lets claims read the outbox id sequence, so an exhausted claim can move the
// cursor to the last id handed out (see cursor). Without it (no sequence, or no privilege to
// read it) claims still work; an idle relay then re-reads the rows deleted since its last
// claim that found rows, until vacuum removes them.
func (r *Relay) findSequence(ctx context.Context) {
	var oid *uint32
	err := r.pool.QueryRow(ctx, `SELECT pg_get_serial_sequence($1, 'id')::regclass::oid`, r.q.outbox).Scan(&oid)
	if err == nil && oid != nil {
		expr := fmt.Sprintf("pg_sequence_last_value(%d::regclass)", *oid)
		var last *int64
		if err = r.pool.QueryRow(ctx, `SELECT `+expr).Scan(&last); err == nil {
			r.q.seqLast = expr
			return
		}
	}
	r.log.Info("relay cannot read the outbox id sequence; idle claims cost more until vacuum runs", "err", err)
}
