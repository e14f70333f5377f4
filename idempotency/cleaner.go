package idempotency

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/onceflow/onceflow/internal/config"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgsql"
	cleaning "github.com/onceflow/onceflow/internal/retention"
	"github.com/onceflow/onceflow/retention"
)

// CleanerConfig configures a Cleaner. Pool is required; the rest has defaults. It has the
// shape of inbox.CleanerConfig, without a window: a record's lifetime is Config.Window, fixed
// when the middleware writes it (expires_at).
type CleanerConfig struct {
	// Pool runs the deletes, each batch in its own short transaction. Required.
	Pool *pgxpool.Pool
	// Schema holds the idempotency_record table. Default "onceflow".
	Schema string
	// BatchSize bounds the rows one delete statement removes and locks.
	// Default retention.DefaultBatchSize (1000).
	BatchSize int
	// Schedule says when Run cleans, e.g. retention.Every(time.Hour) or
	// retention.DailyAt(0, 0) for midnight UTC. Default retention.DefaultSchedule (daily at
	// 03:00 UTC). Clean ignores it.
	Schedule retention.Schedule
	// Logger receives one line per scheduled run (and failures). Default slog.Default().
	Logger *slog.Logger
}

// Cleaner deletes expired idempotency records. The retention itself is decided when a record
// is written (its expires_at, Config.Window after the request); the cleaner only reclaims
// space, since an expired record already counts as absent. It deletes in bounded batches,
// each its own short transaction, and skips rows another transaction has locked, so it never
// waits on or blocks a request — in particular one that is replacing an expired record with
// a fresh response. Records of requests still in flight are not even visible to it: they are
// written in the request's own, uncommitted transaction.
type Cleaner struct {
	cfg CleanerConfig
	sql string
}

// NewCleaner validates cfg, reporting every problem at once, and returns a Cleaner.
func NewCleaner(cfg CleanerConfig) (*Cleaner, error) {
	// The cleaner has no window: each record carries its expires_at.
	var problems []error
	if cfg.Pool == nil {
		problems = append(problems, errors.New("Pool is nil; pass the *pgxpool.Pool that holds the idempotency_record table"))
	}
	problems = append(problems, cleaning.CleanerFields{Schema: &cfg.Schema, BatchSize: &cfg.BatchSize, Schedule: &cfg.Schedule, Logger: &cfg.Logger}.Defaults()...)
	if err := config.Check("idempotency cleaner", problems...); err != nil {
		return nil, err
	}
	t := pgsql.Table(cfg.Schema, "idempotency_record")
	// The inner SELECT walks the expires_at index; SKIP LOCKED leaves rows a request holds.
	sql := `DELETE FROM ` + t + ` WHERE ctid = ANY(ARRAY(SELECT ctid FROM ` + t +
		` WHERE expires_at <= now() ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED))`
	return &Cleaner{cfg: cfg, sql: sql}, nil
}

// Config returns the configuration with defaults filled in.
func (c *Cleaner) Config() CleanerConfig { return c.cfg }

// Clean makes one pass: it deletes every record expired by the database clock, BatchSize
// rows per statement, and returns how many it deleted. Each statement commits on its own; on
// error (or when ctx ends between batches) it returns the count deleted before it.
func (c *Cleaner) Clean(ctx context.Context) (int64, error) {
	n, err := cleaning.DeleteInBatches(ctx, c.cfg.Pool, c.sql, c.cfg.BatchSize)
	if err != nil {
		return n, fmt.Errorf("idempotency: clean %s.idempotency_record (deleted %d rows before the error): %w", c.cfg.Schema, n, err)
	}
	return n, nil
}

// Run calls Clean at every time CleanerConfig.Schedule gives until ctx ends, logging each
// run, and returns ctx's error. A failed run is logged and retried at the next scheduled
// time. Start it in a goroutine of a long-running process: go cleaner.Run(ctx).
func (c *Cleaner) Run(ctx context.Context) error {
	return cleaning.Run(ctx, c.cfg.Schedule, c.cfg.Logger.With("table", "idempotency_record"), c.Clean)
}
