package inbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/config"
	"github.com/onceflow/onceflow/internal/engine"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgsql"
	cleaning "github.com/onceflow/onceflow/internal/retention"
	"github.com/onceflow/onceflow/retention"
)

// DefaultWindow is how long dedup rows are kept by default: 72 hours, long enough for a
// consumer stopped over a weekend.
const DefaultWindow = 72 * time.Hour

// CleanerConfig configures a Cleaner. Pool is required; the rest has defaults. It has the
// shape of idempotency.CleanerConfig, plus the window and the consumer filter.
type CleanerConfig struct {
	// Pool runs the deletes, each batch in its own short transaction. Required.
	Pool *pgxpool.Pool
	// Schema holds processed_event. Default "onceflow".
	Schema string
	// Window is how long a dedup row is kept after it was written. Default DefaultWindow (72h).
	// It must exceed the longest time after which a message can still be delivered again
	// (broker retention of an uncommitted offset, replays, a consumer stopped over a weekend):
	// a redelivery older than the window runs its handler again.
	Window time.Duration
	// AllowShortWindow accepts a Window under retention.MinWindow (24h), for tests and
	// consumers whose redelivery horizon is provably short. Default false: such a window is
	// refused.
	AllowShortWindow bool
	// BatchSize bounds the rows one delete statement removes and locks.
	// Default retention.DefaultBatchSize (1000).
	BatchSize int
	// Consumer restricts cleaning to one consumer's rows, so consumers with different
	// redelivery horizons can keep different windows. Default "": every consumer.
	Consumer string
	// Schedule says when Run cleans, e.g. retention.Every(time.Hour) or
	// retention.DailyAt(0, 0) for midnight UTC. Default retention.DefaultSchedule (daily at
	// 03:00 UTC). Clean ignores it.
	Schedule retention.Schedule
	// Logger receives one line per scheduled run (and failures). Default slog.Default().
	Logger *slog.Logger
	// Sagas says which of the given saga ids are alive (running, compensating or stuck), so
	// that the cleaner keeps their barrier rows however old. Set it for a saga participant
	// whose orchestrator keeps its sagas in another database: saga.Admin.Alive over a pool
	// to that database (a read-only role suffices), or a call to the orchestrator's service.
	// It is asked once per batch, with at most BatchSize ids; an error stops the pass and
	// deletes no barrier row of that batch. Default nil: the sagas are looked up in the saga
	// table of Schema, which holds them when participant and orchestrator share a database;
	// a barrier row whose saga is not found there ages out like any other row.
	Sagas func(ctx context.Context, ids []string) (alive []string, err error)
}

// Cleaner deletes dedup rows older than the retention window, in bounded batches that skip
// rows locked by in-flight inbox transactions, so it never blocks (or waits on) a consumer.
// A saga participant's barrier rows are kept, however old, while their saga (in the saga
// table of the same schema) is running, compensating or stuck: see docs/sagas.md, "The
// barrier".
type Cleaner struct {
	cfg  CleanerConfig
	sql  string
	args []any
	// With CleanerConfig.Sagas: barrierSQL reads a batch of expired barrier rows after a
	// position, dropSQL deletes those of them whose sagas are not alive.
	barrierSQL, dropSQL string
}

// NewCleaner validates cfg, reporting every problem at once, and returns a Cleaner.
func NewCleaner(cfg CleanerConfig) (*Cleaner, error) {
	var problems []error
	if cfg.Pool == nil {
		problems = append(problems, errors.New("Pool is nil; pass the *pgxpool.Pool that holds the processed_event table"))
	}
	problems = append(problems, cleaning.CleanerFields{Schema: &cfg.Schema, BatchSize: &cfg.BatchSize, Schedule: &cfg.Schedule, Logger: &cfg.Logger,
		Window: &cfg.Window, DefaultWindow: DefaultWindow, AllowShortWindow: cfg.AllowShortWindow}.Defaults()...)
	if cfg.Consumer != "" {
		if err := engine.CheckConsumer(cfg.Consumer); err != nil {
			problems = append(problems, err)
		}
	}
	if err := config.Check("inbox cleaner", problems...); err != nil {
		return nil, err
	}
	table := pgsql.Table(cfg.Schema, "processed_event")
	// The age is measured on the database clock, the one that wrote processed_at, so clock
	// skew between application hosts cannot delete rows early. Each batch walks the
	// processed_at index from where the previous one stopped ($1, see
	// retention.DeleteInOrder), so batches cost the same from the first to the last, whatever
	// shared_buffers and synchronize_seqscans are, and the last one stops at the end of the
	// expired range. SKIP LOCKED: a row locked by an in-flight inbox transaction is left for
	// the next run instead of waited on.
	where := `processed_at >= coalesce($1::timestamptz, '-infinity') AND processed_at < now() - make_interval(secs => $2)`
	args := []any{cfg.Window.Seconds()}
	limit := "$3"
	if cfg.Consumer != "" {
		where += ` AND consumer = $3`
		args = append(args, cfg.Consumer)
		limit = "$4"
	}
	c := &Cleaner{cfg: cfg, args: args}
	// A saga participant's barrier row (saga_id set, migration 0015) stays while its saga is
	// not finished, however old: a late retry of the saga's step must find it, or the action
	// would run again (or a compensation be taken for a null one). Without Sagas, one
	// primary-key probe of the saga table per barrier row (other rows skip it; NotLiveBarrier
	// says why not NOT EXISTS, which made a million-saga table's pass 18× slower, measured);
	// with it, barrier rows are left to cleanBarriers. Admin.Expired counts with the same
	// condition.
	barriers := ` AND ` + keptBarriersOut(cfg.Schema, cfg.Sagas != nil)
	if cfg.Sagas != nil {
		// Keyset on (processed_at, consumer, dedup_key): rows kept for live sagas may share a
		// timestamp, and a batch of only those must still move the position on.
		expired := `saga_id IS NOT NULL AND processed_at < now() - make_interval(secs => $4)`
		if cfg.Consumer != "" {
			expired += ` AND consumer = $6`
		}
		c.barrierSQL = `SELECT processed_at, consumer, dedup_key, saga_id FROM ` + table +
			` WHERE processed_at >= coalesce($1::timestamptz, '-infinity') AND (processed_at, consumer, dedup_key) > (coalesce($1::timestamptz, '-infinity'), $2, $3) AND ` + expired +
			` ORDER BY processed_at, consumer, dedup_key LIMIT $5`
		c.dropSQL = `DELETE FROM ` + table + ` WHERE ctid = ANY(ARRAY(SELECT p.ctid FROM unnest($1::text[], $2::text[]) AS u(c, k) JOIN ` + table +
			` p ON p.consumer = u.c AND p.dedup_key = u.k WHERE p.processed_at < now() - make_interval(secs => $3) FOR UPDATE OF p SKIP LOCKED))`
	}
	c.sql = `DELETE FROM ` + table + ` WHERE ctid = ANY(ARRAY(SELECT ctid FROM ` + table +
		` p WHERE ` + where + barriers + ` ORDER BY processed_at LIMIT ` + limit + ` FOR UPDATE OF p SKIP LOCKED)) RETURNING processed_at`
	return c, nil
}

// Config returns the configuration with defaults filled in.
func (c *Cleaner) Config() CleanerConfig { return c.cfg }

// Clean makes one pass: it deletes every dedup row older than the window, BatchSize rows per
// statement, and returns how many it deleted. Each statement commits on its own; when ctx
// ends between batches Clean stops and returns what it deleted so far with ctx's error.
func (c *Cleaner) Clean(ctx context.Context) (int64, error) {
	n, err := cleaning.DeleteInOrder(ctx, c.cfg.Pool, c.sql, c.cfg.BatchSize, c.args...)
	if err == nil && c.cfg.Sagas != nil {
		var m int64
		m, err = c.cleanBarriers(ctx)
		n += m
	}
	if err != nil {
		return n, fmt.Errorf("inbox: clean %s.processed_event (deleted %d rows before the error): %w", c.cfg.Schema, n, err)
	}
	return n, nil
}

// Run calls Clean at every time CleanerConfig.Schedule gives until ctx ends, logging each
// run, and returns ctx's error. A failed run is logged and retried at the next scheduled
// time. Start it in a goroutine of a long-running process: go cleaner.Run(ctx).
func (c *Cleaner) Run(ctx context.Context) error {
	return cleaning.Run(ctx, c.cfg.Schedule, c.cfg.Logger.With("table", "processed_event"), c.Clean)
}

// cleanBarriers deletes the expired barrier rows whose sagas CleanerConfig.Sagas does not
// report alive, a batch at a time: read a batch after the last position, ask which of its
// sagas are alive, delete the rest of the batch.
func (c *Cleaner) cleanBarriers(ctx context.Context) (int64, error) {
	var (
		total        int64
		at           any // NULL: from the start
		consumer, dk string
	)
	for {
		args := []any{at, consumer, dk, c.cfg.Window.Seconds(), c.cfg.BatchSize}
		if c.cfg.Consumer != "" {
			args = append(args, c.cfg.Consumer)
		}
		rows, err := c.cfg.Pool.Query(ctx, c.barrierSQL, args...)
		if err != nil {
			return total, err
		}
		type row struct {
			at                    time.Time
			consumer, key, sagaID string
		}
		batch, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
			var x row
			err := r.Scan(&x.at, &x.consumer, &x.key, &x.sagaID)
			return x, err
		})
		if err != nil || len(batch) == 0 {
			return total, err
		}
		ids := make([]string, 0, len(batch))
		for _, x := range batch {
			ids = append(ids, x.sagaID)
		}
		slices.Sort(ids)
		alive, err := c.cfg.Sagas(ctx, slices.Compact(ids))
		if err != nil {
			return total, fmt.Errorf("CleanerConfig.Sagas: %w (no barrier row of this batch was deleted)", err)
		}
		keep := make(map[string]bool, len(alive))
		for _, id := range alive {
			keep[id] = true
		}
		var consumers, keys []string
		for _, x := range batch {
			if !keep[x.sagaID] {
				consumers, keys = append(consumers, x.consumer), append(keys, x.key)
			}
		}
		if len(keys) > 0 {
			tag, err := c.cfg.Pool.Exec(ctx, c.dropSQL, consumers, keys, c.cfg.Window.Seconds())
			if err != nil {
				return total, err
			}
			total += tag.RowsAffected()
		}
		if len(batch) < c.cfg.BatchSize {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
		last := batch[len(batch)-1]
		at, consumer, dk = last.at, last.consumer, last.key
	}
}
