// Package migrations holds onceflow's versioned SQL, embedded in the binary, and applies it.
//
// Up is safe to run from every process at start-up: a session advisory lock serialises
// concurrent runs, each step runs in its own transaction together with its version row, and
// steps already recorded are skipped, so a second run is a no-op. Teams that manage schema
// with goose, golang-migrate or atlas can take the SQL from Print instead.
package migrations

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"path"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgsql"
)

//go:embed sql/*.sql
var files embed.FS

// schemaToken is replaced in every SQL file by the quoted schema name.
const schemaToken = "{{schema}}"

// versionTable records applied steps inside the configured schema.
const versionTable = "schema_migration"

// Migration is one versioned step.
type Migration struct {
	Version int    // from the file name prefix, e.g. 1 for 0001_init.sql
	Name    string // the rest of the file name, e.g. "init"
	sql     string // with the schema token still in place
}

// Status is a migration and whether (and when) it was applied.
type Status struct {
	Migration
	AppliedAt *time.Time // nil when pending
}

// Options configures where the tables live.
type Options struct {
	// Schema holds every onceflow table. Default "onceflow". Must be a plain identifier.
	Schema string
	// Logger receives one line per applied step. Default: discard.
	Logger *slog.Logger
}

func (o Options) withDefaults() (Options, error) {
	if o.Schema == "" {
		o.Schema = pgsql.DefaultSchema
	}
	if err := pgsql.ValidateSchema(o.Schema); err != nil {
		return o, fmt.Errorf("migrations: %w", err)
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o, nil
}

// All returns every embedded migration in version order.
func All() []Migration {
	entries, err := fs.ReadDir(files, "sql")
	if err != nil {
		panic(err) // embedded at build time; cannot fail at run time
	}
	var out []Migration
	for _, e := range entries {
		name := e.Name()
		prefix, rest, ok := strings.Cut(strings.TrimSuffix(name, ".sql"), "_")
		v, err := strconv.Atoi(prefix)
		if !ok || err != nil {
			panic("migrations: file " + name + " must be named NNNN_name.sql")
		}
		body, err := files.ReadFile(path.Join("sql", name))
		if err != nil {
			panic(err)
		}
		out = append(out, Migration{Version: v, Name: rest, sql: string(body)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out
}

// SQL returns the step's SQL for the given schema.
func (m Migration) SQL(schema string) string {
	return strings.ReplaceAll(m.sql, schemaToken, pgsql.Ident(schema))
}

// Up applies every pending migration and returns those it applied (none when up to date).
func Up(ctx context.Context, pool *pgxpool.Pool, opts Options) ([]Migration, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	var applied []Migration
	err = withLock(ctx, pool, opts.Schema, func(conn *pgx.Conn) error {
		done, err := appliedVersions(ctx, conn, opts.Schema)
		if err != nil {
			return err
		}
		for _, m := range All() {
			if _, ok := done[m.Version]; ok {
				continue
			}
			err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, m.SQL(opts.Schema)); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, "INSERT INTO "+pgsql.Table(opts.Schema, versionTable)+" (version, name) VALUES ($1, $2)", m.Version, m.Name)
				return err
			})
			if err != nil {
				return fmt.Errorf("migrations: apply %04d_%s to schema %q: %w", m.Version, m.Name, opts.Schema, err)
			}
			opts.Logger.Info("migration applied", "schema", opts.Schema, "version", m.Version, "name", m.Name)
			applied = append(applied, m)
		}
		return nil
	})
	return applied, err
}

// Statuses lists every known migration and when it was applied in the schema.
func Statuses(ctx context.Context, pool *pgxpool.Pool, opts Options) ([]Status, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	var exists bool
	if err := pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", pgsql.Table(opts.Schema, versionTable)).Scan(&exists); err != nil {
		return nil, fmt.Errorf("migrations: read status: %w", err)
	}
	done := map[int]time.Time{}
	if exists {
		rows, err := pool.Query(ctx, "SELECT version, applied_at FROM "+pgsql.Table(opts.Schema, versionTable))
		if err != nil {
			return nil, fmt.Errorf("migrations: read status: %w", err)
		}
		var v int
		var at time.Time
		if _, err := pgx.ForEachRow(rows, []any{&v, &at}, func() error { done[v] = at; return nil }); err != nil {
			return nil, fmt.Errorf("migrations: read status: %w", err)
		}
	}
	var out []Status
	for _, m := range All() {
		s := Status{Migration: m}
		if at, ok := done[m.Version]; ok {
			s.AppliedAt = &at
		}
		out = append(out, s)
	}
	return out, nil
}

// Print returns the SQL of every migration for the schema, ready for another migration tool.
// It also creates and fills the version table, so a later Up sees the steps as applied.
func Print(opts Options) (string, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return "", err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "-- onceflow schema for %q, generated by `onceflow migrate print`.\n", opts.Schema)
	b.WriteString(bootstrapSQL(opts.Schema) + ";\n")
	for _, m := range All() {
		fmt.Fprintf(&b, "\n-- ---- %04d_%s ----\n%s\n", m.Version, m.Name, strings.TrimSpace(m.SQL(opts.Schema)))
		fmt.Fprintf(&b, "INSERT INTO %s (version, name) VALUES (%d, '%s') ON CONFLICT DO NOTHING;\n", pgsql.Table(opts.Schema, versionTable), m.Version, m.Name)
	}
	return b.String(), nil
}

func bootstrapSQL(schema string) string {
	return "CREATE SCHEMA IF NOT EXISTS " + pgsql.Ident(schema) + ";\n" +
		"CREATE TABLE IF NOT EXISTS " + pgsql.Table(schema, versionTable) + " (\n" +
		"    version    integer     PRIMARY KEY,\n" +
		"    name       text        NOT NULL,\n" +
		"    applied_at timestamptz NOT NULL DEFAULT now()\n)"
}

// withLock runs fn on one connection holding a session advisory lock per schema, so
// concurrent migrators queue instead of racing on CREATE statements.
func withLock(ctx context.Context, pool *pgxpool.Pool, schema string, fn func(*pgx.Conn) error) (err error) {
	pc, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("migrations: acquire connection: %w", err)
	}
	defer pc.Release()
	conn := pc.Conn()
	const lockSQL = "SELECT pg_advisory_lock(hashtext('onceflow.migrate'), hashtext($1))"
	if _, err := conn.Exec(ctx, lockSQL, schema); err != nil {
		return fmt.Errorf("migrations: take advisory lock: %w", err)
	}
	defer func() {
		// Unlock on a fresh context: ctx may be cancelled, and a leaked session lock would
		// block the next migrator until this pooled connection closes.
		uctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, uerr := conn.Exec(uctx, "SELECT pg_advisory_unlock(hashtext('onceflow.migrate'), hashtext($1))", schema); uerr != nil {
			pc.Hijack().Close(uctx) // drop the connection, and the lock with it
			err = errors.Join(err, fmt.Errorf("migrations: release advisory lock: %w", uerr))
		}
	}()
	if _, err := conn.Exec(ctx, bootstrapSQL(schema)); err != nil {
		return fmt.Errorf("migrations: create schema %q: %w", schema, err)
	}
	return fn(conn)
}

func appliedVersions(ctx context.Context, conn *pgx.Conn, schema string) (map[int]struct{}, error) {
	rows, err := conn.Query(ctx, "SELECT version FROM "+pgsql.Table(schema, versionTable))
	if err != nil {
		return nil, fmt.Errorf("migrations: read applied versions: %w", err)
	}
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return nil, fmt.Errorf("migrations: read applied versions: %w", err)
	}
	done := make(map[int]struct{}, len(versions))
	for _, v := range versions {
		done[v] = struct{}{}
	}
	return done, nil
}
