package idempotency

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/retention"
)

// CleanerConfig configures a Cleaner. Pool is required.
type CleanerConfig struct {
	// Pool holds the idempotency_record table. Required.
	Pool *pgxpool.Pool
	// Schema holds the table. Default "onceflow".
	Schema string
	// BatchSize bounds the rows one delete statement removes and locks.
	// Default retention.DefaultBatchSize (1000).
	BatchSize int
	// Logger receives one line per scheduled run (Run). Default: discard.
	Logger *slog.Logger
}

// Cleaner deletes expired idempotency records. The retention itself is decided when a record
// is written (its expires_at); the cleaner only reclaims space, since an expired record
// already counts as absent. It deletes in bounded batches, each its own short transaction,
// and skips rows another transaction has locked, so it never waits on or blocks a request —
// in particular one that is replacing an expired record with a fresh response. Records of
// requests still in flight are not even visible to it: they are written in the request's own,
// uncommitted transaction.
type Cleaner struct {
	cfg CleanerConfig
	sql string
}

// NewCleaner validates cfg, reporting every problem at once.
func NewCleaner(cfg CleanerConfig) (*Cleaner, error) {
	var problems []error
	if cfg.Pool == nil {
		problems = append(problems, errors.New("Pool is nil; pass the *pgxpool.Pool that holds the idempotency_record table"))
	}
	if cfg.Schema == "" {
		cfg.Schema = pgsql.DefaultSchema
	}
	if err := pgsql.ValidateSchema(cfg.Schema); err != nil {
		problems = append(problems, fmt.Errorf("Schema: %w", err))
	}
	if cfg.BatchSize < 0 {
		problems = append(problems, fmt.Errorf("BatchSize is %d; use 0 for the default (%d) or a positive size", cfg.BatchSize, retention.DefaultBatchSize))
	} else if cfg.BatchSize == 0 {
		cfg.BatchSize = retention.DefaultBatchSize
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if err := errors.Join(problems...); err != nil {
		return nil, fmt.Errorf("idempotency: invalid cleaner config: %w", err)
	}
	t := pgsql.Table(cfg.Schema, "idempotency_record")
	// The inner SELECT walks the expires_at index; SKIP LOCKED leaves rows a request holds.
	sql := `DELETE FROM ` + t + ` WHERE ctid = ANY(ARRAY(SELECT ctid FROM ` + t +
		` WHERE expires_at <= now() ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED))`
	return &Cleaner{cfg: cfg, sql: sql}, nil
}

// RunOnce deletes every record expired by the database clock, in batches, and returns how
// many it deleted. On error it returns the count deleted before the error.
func (c *Cleaner) RunOnce(ctx context.Context) (int64, error) {
	n, err := retention.DeleteInBatches(ctx, c.cfg.Pool, c.sql, c.cfg.BatchSize)
	if err != nil {
		return n, fmt.Errorf("idempotency: delete expired records from %s.idempotency_record: %w", c.cfg.Schema, err)
	}
	return n, nil
}

// Schedule says when Run cleans next, e.g. every hour or daily at 03:00 UTC.
type Schedule interface {
	Next(now time.Time) time.Time
}

// Run calls RunOnce on the schedule until ctx ends, logging each run, and returns ctx's
// error. A failed run is logged and retried at the next scheduled time.
func (c *Cleaner) Run(ctx context.Context, s Schedule) error {
	return retention.Run(ctx, s, c.cfg.Logger.With("cleaner", "idempotency"), c.RunOnce)
}
