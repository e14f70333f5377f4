// Package retention is the engine behind onceflow's cleaners: window validation, the
// defaults and checks of the fields every cleaner's config shares, deletion in bounded
// batches, and the loop that runs a cleaner on a schedule inside a long-running process.
//
// The user-facing vocabulary (Schedule, Every, DailyAt, DefaultSchedule, MinWindow,
// DefaultBatchSize) is the public package github.com/onceflow/onceflow/retention, a leaf
// that imports nothing of onceflow's: internal/ may import it (as River's internals import
// rivertype), so each of those values is written once, there.
package retention

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/retention"
)

// CleanerFields points at the fields every cleaner's config has (inbox.CleanerConfig,
// saga.CleanerConfig, idempotency.CleanerConfig), so that their defaults and checks are
// written once. A nil Window means the cleaner has no window of its own (the idempotency
// cleaner deletes by each record's expires_at).
type CleanerFields struct {
	Schema    *string
	BatchSize *int
	Schedule  *retention.Schedule
	Logger    **slog.Logger

	Window           *time.Duration
	DefaultWindow    time.Duration // replaces a zero *Window
	AllowShortWindow bool
}

// Defaults fills the zero fields with their defaults (pgsql.DefaultSchema,
// retention.DefaultBatchSize, retention.DefaultSchedule, slog.Default(), DefaultWindow) and
// returns one problem per field that is still invalid, named as the config's field is, for
// the cleaner's constructor to report with the rest of its config.
func (f CleanerFields) Defaults() []error {
	if *f.Schema == "" {
		*f.Schema = pgsql.DefaultSchema
	}
	if *f.BatchSize == 0 {
		*f.BatchSize = retention.DefaultBatchSize
	}
	if *f.Schedule == nil {
		*f.Schedule = retention.DefaultSchedule
	}
	if *f.Logger == nil {
		*f.Logger = slog.Default()
	}
	if f.Window != nil && *f.Window == 0 {
		*f.Window = f.DefaultWindow
	}
	var problems []error
	if err := pgsql.ValidateSchema(*f.Schema); err != nil {
		problems = append(problems, fmt.Errorf("Schema: %w", err))
	}
	if f.Window != nil {
		if err := CheckWindow("Window", *f.Window, f.AllowShortWindow, "AllowShortWindow"); err != nil {
			problems = append(problems, err)
		}
	}
	if *f.BatchSize < 0 {
		problems = append(problems, fmt.Errorf("BatchSize is %d; use 0 for the default (%d) or a positive size", *f.BatchSize, retention.DefaultBatchSize))
	}
	if err := CheckSchedule(*f.Schedule); err != nil {
		problems = append(problems, fmt.Errorf("Schedule: %w", err))
	}
	return problems
}

// CheckWindow refuses a window <= 0, and one under retention.MinWindow unless allowShort is set. name
// and override are the field (or flag) names the error quotes, e.g. "Window" and
// "AllowShortWindow".
func CheckWindow(name string, window time.Duration, allowShort bool, override string) error {
	if window <= 0 {
		return fmt.Errorf("%s is %s; it must be positive (leave it 0 in a config for the default)", name, window)
	}
	if window < retention.MinWindow && !allowShort {
		return fmt.Errorf("%s is %s, under the %s minimum: records deleted too early let late redeliveries or retries run again; raise it, or set %s if the redelivery horizon is provably shorter", name, window, retention.MinWindow, override)
	}
	return nil
}

// Execer runs one statement; *pgxpool.Pool and pgx.Tx satisfy it. Pass a pool so each batch
// commits on its own and holds its row locks only briefly.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// DeleteInBatches runs query repeatedly until it deletes fewer than batchSize rows, and
// returns the total deleted. query must delete at most its last parameter's worth of rows,
// e.g. DELETE FROM t WHERE ctid = ANY(ARRAY(SELECT ctid FROM t WHERE ... LIMIT $2 FOR UPDATE
// SKIP LOCKED)) — SKIP LOCKED so the cleaner never waits on (or blocks) a writer's row.
func DeleteInBatches(ctx context.Context, db Execer, query string, batchSize int, args ...any) (int64, error) {
	if batchSize <= 0 {
		batchSize = retention.DefaultBatchSize
	}
	args = append(args, batchSize)
	var total int64
	for {
		tag, err := db.Exec(ctx, query, args...)
		if err != nil {
			return total, err
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batchSize) {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
	}
}

// Querier runs one statement returning rows; *pgxpool.Pool and pgx.Tx satisfy it.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// DeleteInOrder deletes in batches that walk a timestamp index in order, each batch starting
// where the previous one stopped, and returns the total deleted. query takes the position as
// $1 (NULL for the first batch: start at the beginning), then args, then the batch size as
// its last parameter, and returns the key of every row it deleted, e.g.
//
//	DELETE FROM t WHERE ctid = ANY(ARRAY(SELECT ctid FROM t
//	    WHERE at >= coalesce($1::timestamptz, '-infinity') AND at < $2
//	    ORDER BY at LIMIT $3 FOR UPDATE SKIP LOCKED)) RETURNING at
//
// Why not DeleteInBatches with a plain LIMIT: without an order, PostgreSQL reads the table
// sequentially, and every batch rescans the pages the previous batches emptied (it stays
// linear only while synchronized sequential scans happen to resume where the last scan
// stopped, which they do only for tables larger than a quarter of shared_buffers); ordered
// from the start, every batch re-reads the index entries of the rows already deleted until
// vacuum removes them. From the last position, each batch reads about its own rows, and the
// last batch stops at the end of the expired range instead of scanning the table. Rows with
// the same key as the position are read again (>=), so none is skipped.
func DeleteInOrder(ctx context.Context, db Querier, query string, batchSize int, args ...any) (int64, error) {
	if batchSize <= 0 {
		batchSize = retention.DefaultBatchSize
	}
	var pos any // NULL: from the start
	var total int64
	for {
		rows, err := db.Query(ctx, query, append(append([]any{pos}, args...), batchSize)...)
		if err != nil {
			return total, err
		}
		var n int64
		var last time.Time
		for rows.Next() {
			var at time.Time
			if err := rows.Scan(&at); err != nil {
				rows.Close()
				return total, err
			}
			if n == 0 || at.After(last) {
				last = at
			}
			n++
		}
		if err := rows.Err(); err != nil {
			return total, err
		}
		total += n
		if n < int64(batchSize) {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
		pos = last
	}
}

// CheckSchedule reports a schedule that cannot run: nil, or one whose Validate method (the
// public Every and DailyAt have one; users' own schedules may) returns an error.
func CheckSchedule(s retention.Schedule) error {
	if s == nil {
		return fmt.Errorf("the schedule is nil")
	}
	if v, ok := s.(interface{ Validate() error }); ok {
		return v.Validate()
	}
	return nil
}

// Run calls clean at every time the schedule gives until ctx ends. A failed run is logged and
// retried at the next scheduled time; Run returns ctx's error, or at once the error of a
// schedule that cannot run (CheckSchedule).
func Run(ctx context.Context, s retention.Schedule, logger *slog.Logger, clean func(context.Context) (int64, error)) error {
	if err := CheckSchedule(s); err != nil {
		return fmt.Errorf("retention: %w", err)
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	for {
		t := time.NewTimer(time.Until(s.Next(time.Now())))
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		start := time.Now()
		n, err := clean(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err() // stopped mid-run: not a failure worth an error line
			}
			logger.Error("retention cleanup failed; retrying at the next scheduled time", "err", err, "deleted", n)
			continue
		}
		logger.Info("retention cleanup done", "deleted", n, "took", time.Since(start))
	}
}

// NotLiveBarrier is the condition, on a processed_event row (column saga_id, unqualified),
// that it is not a saga participant's barrier row of a saga alive in the saga table of
// schema: inbox.Cleaner keeps those however old, and what counts expired rows (`onceflow
// status`, `cleanup --dry-run`) must not count them. A scalar subquery, one primary-key probe
// per barrier row: NOT EXISTS under OR becomes a hashed subplan that reads every live saga
// per statement.
func NotLiveBarrier(schema string) string {
	return `(saga_id IS NULL OR (SELECT s.finished_at IS NULL FROM ` + pgsql.Table(schema, "saga") +
		` s WHERE s.id = saga_id) IS NOT TRUE)`
}
