// Package retention is the shared engine behind onceflow's cleaners: window validation,
// deletion in bounded batches, and a schedule to run a cleaner inside a long-running process.
package retention

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// MinWindow is the shortest retention accepted without an explicit override: a dedup or
// idempotency record must outlive every realistic redelivery or client retry.
const MinWindow = 24 * time.Hour

// DefaultBatchSize bounds the rows one delete statement removes (and locks).
const DefaultBatchSize = 1000

// CheckWindow refuses a window under MinWindow unless allowShort is set, and any window <= 0.
func CheckWindow(name string, window time.Duration, allowShort bool) error {
	if window <= 0 {
		return fmt.Errorf("%s is %s; it must be positive", name, window)
	}
	if window < MinWindow && !allowShort {
		return fmt.Errorf("%s is %s, under the %s minimum: records deleted too early let late redeliveries or retries run again; raise it or set the explicit short-retention override", name, window, MinWindow)
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
		batchSize = DefaultBatchSize
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

// Schedule says when a cleaner runs next.
type Schedule interface {
	Next(now time.Time) time.Time
}

// Every runs at a fixed interval.
type Every time.Duration

// Next implements Schedule.
func (e Every) Next(now time.Time) time.Time { return now.Add(time.Duration(e)) }

// DailyAt runs once a day at the given UTC time of day (e.g. 3*time.Hour for 03:00 UTC).
type DailyAt time.Duration

// DefaultDaily is 03:00 UTC, when most services are quiet.
const DefaultDaily = DailyAt(3 * time.Hour)

// Next implements Schedule.
func (d DailyAt) Next(now time.Time) time.Time {
	now = now.UTC()
	next := now.Truncate(24 * time.Hour).Add(time.Duration(d))
	if !next.After(now) {
		next = next.Add(24 * time.Hour)
	}
	return next
}

// Run calls clean at every time the schedule gives until ctx ends. A failed run is logged and
// retried at the next scheduled time; Run returns ctx's error.
func Run(ctx context.Context, s Schedule, logger *slog.Logger, clean func(context.Context) (int64, error)) error {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	for {
		wait := time.Until(s.Next(time.Now()))
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		start := time.Now()
		n, err := clean(ctx)
		if err != nil {
			logger.Error("retention cleanup failed; retrying at the next scheduled time", "err", err, "deleted", n)
			continue
		}
		logger.Info("retention cleanup done", "deleted", n, "took", time.Since(start))
	}
}
