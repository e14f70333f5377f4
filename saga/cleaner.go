package saga

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/config"
	"github.com/onceflow/onceflow/internal/pgsql"
	cleaning "github.com/onceflow/onceflow/internal/retention"
	"github.com/onceflow/onceflow/retention"
)

// DefaultWindow is how long a finished saga (completed or compensated) is kept for `onceflow
// saga show` before the cleaner removes it: 72 hours.
const DefaultWindow = 72 * time.Hour

// CleanerConfig configures a Cleaner; it has the shape of inbox.CleanerConfig. Pool is
// required; the rest has defaults.
type CleanerConfig struct {
	// Pool runs the deletes, each batch in its own short transaction. Required.
	Pool *pgxpool.Pool
	// Schema holds the saga table. Default "onceflow".
	Schema string
	// Window is how long a saga is kept after it finished. Default DefaultWindow (72h). A
	// reply that arrives for a removed saga is acknowledged and ignored, so the window only
	// bounds how long finished sagas stay visible.
	Window time.Duration
	// AllowShortWindow accepts a Window under retention.MinWindow (24h). Default false.
	AllowShortWindow bool
	// BatchSize bounds the rows one delete statement removes and locks.
	// Default retention.DefaultBatchSize (1000).
	BatchSize int
	// Schedule says when Run cleans. Default retention.DefaultSchedule (daily at 03:00 UTC).
	Schedule retention.Schedule
	// Logger receives one line per scheduled run (and failures). Default slog.Default().
	Logger *slog.Logger
}

// Cleaner deletes finished sagas older than the window, in bounded batches that walk the
// finished_at index and skip locked rows. Running, compensating and stuck sagas are never
// deleted, however old.
type Cleaner struct {
	cfg CleanerConfig
	sql string
}

// NewCleaner validates cfg, reporting every problem at once (*ConfigError).
func NewCleaner(cfg CleanerConfig) (*Cleaner, error) {
	var problems []error
	if cfg.Pool == nil {
		problems = append(problems, errors.New("Pool is nil; pass the *pgxpool.Pool that holds the saga table"))
	}
	problems = append(problems, cleaning.CleanerFields{Schema: &cfg.Schema, BatchSize: &cfg.BatchSize, Schedule: &cfg.Schedule, Logger: &cfg.Logger,
		Window: &cfg.Window, DefaultWindow: DefaultWindow, AllowShortWindow: cfg.AllowShortWindow}.Defaults()...)
	if err := config.Check("saga cleaner", problems...); err != nil {
		return nil, err
	}
	t := pgsql.Table(cfg.Schema, "saga")
	// finished_at is set only for completed and compensated sagas; the partial index holds
	// just those, in order, so each batch reads only rows it deletes.
	return &Cleaner{cfg: cfg, sql: `DELETE FROM ` + t + ` WHERE id = ANY(ARRAY(SELECT id FROM ` + t +
		` WHERE finished_at IS NOT NULL AND finished_at < now() - make_interval(secs => $1) ORDER BY finished_at LIMIT $2 FOR UPDATE SKIP LOCKED))`}, nil
}

// Config returns the configuration with defaults filled in.
func (c *Cleaner) Config() CleanerConfig { return c.cfg }

// Clean makes one pass: it deletes every saga that finished before the window, BatchSize
// per statement, and returns how many it deleted.
func (c *Cleaner) Clean(ctx context.Context) (int64, error) {
	n, err := cleaning.DeleteInBatches(ctx, c.cfg.Pool, c.sql, c.cfg.BatchSize, c.cfg.Window.Seconds())
	if err != nil {
		return n, fmt.Errorf("saga: clean %s.saga (deleted %d rows before the error): %w", c.cfg.Schema, n, schemaError(c.cfg.Schema, err))
	}
	return n, nil
}

// Run calls Clean at every time CleanerConfig.Schedule gives until ctx ends, and returns ctx's
// error. A failed run is logged and retried at the next scheduled time.
func (c *Cleaner) Run(ctx context.Context) error {
	return cleaning.Run(ctx, c.cfg.Schedule, c.cfg.Logger.With("table", "saga"), c.Clean)
}
