package inbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/retention"
)

// DefaultRetention is how long dedup rows are kept by default: 72 hours.
const DefaultRetention = 72 * time.Hour

// MinRetention is the shortest window accepted without CleanerConfig.AllowShortWindow.
const MinRetention = retention.MinWindow

// DefaultCleanBatch is the default number of rows one delete statement removes.
const DefaultCleanBatch = retention.DefaultBatchSize

// DefaultCleanAt is the default time of day (UTC) Cleaner.Run cleans at: 03:00.
const DefaultCleanAt = 3 * time.Hour

// Execer runs one SQL statement. *pgxpool.Pool satisfies it; pass the pool (not a
// transaction) so every batch commits on its own and holds its row locks only briefly.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// CleanerConfig configures a Cleaner. DB is required; the rest has defaults.
type CleanerConfig struct {
	// DB runs the deletes. Required; pass the *pgxpool.Pool.
	DB Execer
	// Schema holds processed_event. Default "onceflow".
	Schema string
	// Window is how long a dedup row is kept after it was written. Default 72h. It must exceed
	// the longest time after which a message can still be delivered again (broker retention of
	// an uncommitted offset, replays, a consumer stopped over a weekend): a redelivery older
	// than the window runs its handler again.
	Window time.Duration
	// AllowShortWindow accepts a Window under 24h (MinRetention), for tests and consumers whose
	// redelivery horizon is provably short. Default false: such a window is refused.
	AllowShortWindow bool
	// BatchSize bounds the rows one delete statement removes and locks. Default 1000.
	BatchSize int
	// Consumer restricts cleaning to one consumer's rows, so consumers with different
	// redelivery horizons can keep different windows. Default "": every consumer.
	Consumer string
	// Interval makes Run clean at this fixed interval. Default 0: once a day at DailyAt.
	Interval time.Duration
	// DailyAt is the UTC time of day Run cleans at when Interval is 0. Default 03:00
	// (DefaultCleanAt); use 24h for midnight.
	DailyAt time.Duration
	// Logger receives one line per run (and failures). Default slog.Default().
	Logger *slog.Logger
}

// Cleaner deletes dedup rows older than the retention window, in bounded batches that skip
// rows locked by in-flight inbox transactions, so it never blocks (or waits on) a consumer.
type Cleaner struct {
	cfg      CleanerConfig
	sql      string
	args     []any
	schedule retention.Schedule
}

// NewCleaner validates cfg, reporting every problem at once, and returns a Cleaner.
func NewCleaner(cfg CleanerConfig) (*Cleaner, error) {
	if cfg.Schema == "" {
		cfg.Schema = pgsql.DefaultSchema
	}
	if cfg.Window == 0 {
		cfg.Window = DefaultRetention
	}
	if cfg.BatchSize == 0 {
		cfg.BatchSize = DefaultCleanBatch
	}
	if cfg.DailyAt == 0 {
		cfg.DailyAt = DefaultCleanAt
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	var problems []error
	if cfg.DB == nil {
		problems = append(problems, errors.New("DB is nil; pass the *pgxpool.Pool"))
	}
	if err := pgsql.ValidateSchema(cfg.Schema); err != nil {
		problems = append(problems, err)
	}
	if err := retention.CheckWindow("Window", cfg.Window, cfg.AllowShortWindow); err != nil {
		problems = append(problems, fmt.Errorf("%w (CleanerConfig.AllowShortWindow)", err))
	}
	if cfg.BatchSize < 0 {
		problems = append(problems, fmt.Errorf("BatchSize is %d; use 0 for the default (%d) or a positive number", cfg.BatchSize, DefaultCleanBatch))
	}
	if cfg.Interval < 0 {
		problems = append(problems, fmt.Errorf("Interval is %s; use 0 to clean daily at DailyAt, or a positive interval", cfg.Interval))
	}
	if cfg.DailyAt < 0 || cfg.DailyAt > 24*time.Hour {
		problems = append(problems, fmt.Errorf("DailyAt is %s; use a time of day between 0s and 24h (e.g. 3*time.Hour for 03:00 UTC)", cfg.DailyAt))
	}
	if cfg.Consumer != "" {
		if err := validateConsumer(cfg.Consumer); err != nil {
			problems = append(problems, err)
		}
	}
	if err := errors.Join(problems...); err != nil {
		return nil, fmt.Errorf("inbox: invalid cleaner config: %w", err)
	}
	table := pgsql.Table(cfg.Schema, "processed_event")
	// The age is measured on the database clock, the one that wrote processed_at, so clock
	// skew between application hosts cannot delete rows early. SKIP LOCKED: a row locked by an
	// in-flight inbox transaction is left for the next run instead of waited on.
	where := `processed_at < now() - make_interval(secs => $1)`
	args := []any{cfg.Window.Seconds()}
	limit := "$2"
	if cfg.Consumer != "" {
		where += ` AND consumer = $2`
		args = append(args, cfg.Consumer)
		limit = "$3"
	}
	c := &Cleaner{
		cfg: cfg,
		sql: `DELETE FROM ` + table + ` WHERE ctid = ANY(ARRAY(SELECT ctid FROM ` + table +
			` WHERE ` + where + ` LIMIT ` + limit + ` FOR UPDATE SKIP LOCKED))`,
		args:     args,
		schedule: retention.DailyAt(cfg.DailyAt),
	}
	if cfg.Interval > 0 {
		c.schedule = retention.Every(cfg.Interval)
	}
	return c, nil
}

// Config returns the configuration with defaults filled in.
func (c *Cleaner) Config() CleanerConfig { return c.cfg }

// Clean deletes every dedup row older than the window, BatchSize rows per statement, and
// returns how many it deleted. Each statement commits on its own; when ctx ends between
// batches Clean stops and returns what it deleted so far with ctx's error.
func (c *Cleaner) Clean(ctx context.Context) (int64, error) {
	n, err := retention.DeleteInBatches(ctx, c.cfg.DB, c.sql, c.cfg.BatchSize, c.args...)
	if err != nil {
		return n, fmt.Errorf("inbox: clean processed_event (deleted %d rows before the error): %w", n, err)
	}
	return n, nil
}

// Run cleans on the configured schedule (every Interval, or daily at DailyAt UTC) until ctx
// ends, and returns ctx's error. A failed run is logged and retried at the next scheduled
// time. Start it in a goroutine of a long-running process: go cleaner.Run(ctx).
func (c *Cleaner) Run(ctx context.Context) error {
	return retention.Run(ctx, c.schedule, c.cfg.Logger.With("table", "processed_event"), c.Clean)
}
