package saga

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/migrations"
)

// CheckSchema reports whether the orchestrator's schema is fully migrated (migrations.Validate):
// nil, or an error wrapping migrations.ErrNotMigrated that lists the missing steps and names
// the command to run. Call it at start-up, before the router and Run start, to fail fast
// instead of on the first reply or timer.
func (o *Orchestrator) CheckSchema(ctx context.Context) error {
	return migrations.Validate(ctx, o.cfg.Pool, migrations.Options{Schema: o.cfg.Schema, Logger: o.cfg.Logger})
}

// CheckSchema reports whether the participant's schema is fully migrated, like
// Orchestrator.CheckSchema. Call it at start-up, before the router runs.
func (p *Participant) CheckSchema(ctx context.Context) error {
	return migrations.Validate(ctx, p.cfg.Pool, migrations.Options{Schema: p.cfg.Schema, Logger: p.cfg.Logger})
}

// undefinedColumn is SQLSTATE 42703: a column a later migration adds (processed_event.result,
// 0009) is missing.
const undefinedColumn = "42703"

// schemaError wraps an error of one of onceflow's own statements: a missing table
// (SQLSTATE 42P01) means the schema was never migrated or lacks the saga steps, which the
// error says how to fix and which errors.Is(err, migrations.ErrNotMigrated) matches; so does
// a missing column (SQLSTATE 42703) of a later step. Only
// for statements on onceflow's tables: a handler's missing business table is not ours to
// explain.
func schemaError(schema string, err error) error {
	var pgErr *pgconn.PgError
	missing := errors.As(err, &pgErr) && (pgErr.Code == pgsql.UndefinedTable || pgErr.Code == undefinedColumn)
	if err == nil || errors.Is(err, migrations.ErrNotMigrated) || !missing {
		return err
	}
	return fmt.Errorf("%w: schema %q lacks onceflow's saga tables (or the inbox's and the outbox's); "+
		"run `onceflow migrate up --schema %s` (or migrations.Up) before starting: %w",
		migrations.ErrNotMigrated, schema, schema, err)
}
