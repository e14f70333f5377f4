// Package migrations holds onceflow's versioned SQL, embedded in the binary, and applies it.
//
// Up is safe to run from every process at start-up: a per-schema advisory lock serialises
// concurrent runs, each step runs in its own transaction together with its version row, and
// steps already recorded are skipped, so a second run is a no-op. UpTx applies the steps in
// the caller's transaction instead, under the same lock. Validate tells a service at start-up
// whether its schema has every step it needs, with the command to run when it has not.
// Teams that manage schema with goose, golang-migrate or atlas can take the SQL from Print.
package migrations

import (
	"context"
	"embed"
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
	// Unknown is true for a step recorded in the schema that this binary does not embed: a
	// newer onceflow applied it. Its SQL is unknown; Version, Name and AppliedAt are set.
	Unknown bool
}

// Options configures where the tables live.
type Options struct {
	// Schema holds every onceflow table. Default "onceflow". Must be a plain identifier.
	Schema string
	// Logger receives one line per applied step, and a warning per step in the schema that
	// this binary does not know (a newer release applied it). Default: discard.
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

// DB is what Statuses and Validate read through: a *pgxpool.Pool, *pgx.Conn or pgx.Tx.
// Passing the transaction that is about to use the tables checks exactly what it will see.
type DB interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Up applies every pending migration and returns those it applied (none when up to date; on
// an error, those committed before it).
//
// Each step commits in a transaction of its own, together with its version row, under the
// same per-schema lock UpTx takes; so concurrent runs queue, a failed step leaves the steps
// before it applied, and the next run resumes at the failed one. Up waits for a migrator that
// holds the lock (another Up, or an UpTx whose transaction is still open) until ctx ends.
func Up(ctx context.Context, pool *pgxpool.Pool, opts Options) ([]Migration, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	var applied []Migration
	for {
		var step, unknown []Migration
		// READ COMMITTED explicitly: the server's default_transaction_isolation may be stricter,
		// and migrate needs each statement to see what an earlier lock holder committed.
		err := pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
			var err error
			step, unknown, err = migrate(ctx, tx, opts, 1)
			return err
		})
		if err != nil {
			return applied, err
		}
		if len(step) == 0 {
			warnUnknown(opts, unknown)
			return applied, nil
		}
		for _, m := range step {
			opts.Logger.Info("migration applied", "schema", opts.Schema, "version", m.Version, "name", m.Name)
		}
		applied = append(applied, step...)
	}
}

// UpTx applies every pending migration inside tx and returns those it ran; they take effect
// when the caller commits tx, and vanish if it rolls back. Use it to create onceflow's tables
// in the same transaction as the application's own schema changes.
//
// Locking: UpTx first takes pg_advisory_xact_lock on the same per-schema key Up uses, so two
// processes never migrate one schema at once: a second UpTx (or Up) waits until tx commits or
// rolls back, then sees the steps tx applied and runs only what is still pending. The lock is
// held until tx ends, so keep the transaction short after UpTx; other migrators of the schema
// queue behind it (relays and handlers do not take this lock and are not blocked by it, only
// by the DDL's own table locks).
//
// tx must be READ COMMITTED, PostgreSQL's default: at a stricter isolation level a transaction
// that waited for the lock would read the version table as it was before the other migrator
// committed, and apply the steps again. UpTx refuses such a transaction.
//
// When a step fails, UpTx returns no steps and tx is aborted: roll it back, and nothing of
// this call is applied.
func UpTx(ctx context.Context, tx pgx.Tx, opts Options) ([]Migration, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	applied, unknown, err := migrate(ctx, tx, opts, 0)
	for _, m := range applied {
		opts.Logger.Info("migration run in the caller's transaction; applied when it commits", "schema", opts.Schema, "version", m.Version, "name", m.Name)
	}
	warnUnknown(opts, unknown)
	return applied, err
}

// lockSQL takes the per-schema migration lock for the rest of the transaction. The key is
// shared by Up and UpTx; the same key in PostgreSQL's advisory lock space also conflicts with
// the session-level lock older onceflow releases took, so mixed versions still queue.
const lockSQL = "SELECT pg_advisory_xact_lock(hashtext('onceflow.migrate'), hashtext($1))"

// migrate is the engine behind Up and UpTx: in tx, it takes the schema's migration lock,
// creates the schema and version table if needed, and applies up to limit pending steps in
// version order (limit 0 = all). It also returns the recorded steps this binary does not know.
func migrate(ctx context.Context, tx pgx.Tx, opts Options, limit int) (applied, unknown []Migration, err error) {
	var isolation string
	if err := tx.QueryRow(ctx, "SELECT current_setting('transaction_isolation')").Scan(&isolation); err != nil {
		return nil, nil, fmt.Errorf("migrations: read transaction isolation: %w", err)
	}
	if isolation != "read committed" {
		return nil, nil, fmt.Errorf("migrations: the transaction is %s; migrating needs READ COMMITTED (PostgreSQL's default), "+
			"because a transaction that waits for another migrator must then see what that one committed; "+
			"begin it with pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, or call migrations.Up", strings.ToUpper(isolation))
	}
	if _, err := tx.Exec(ctx, lockSQL, opts.Schema); err != nil {
		return nil, nil, fmt.Errorf("migrations: take the migration lock of schema %q: %w", opts.Schema, err)
	}
	if _, err := tx.Exec(ctx, bootstrapSQL(opts.Schema)); err != nil {
		return nil, nil, fmt.Errorf("migrations: create schema %q: %w", opts.Schema, err)
	}
	recorded, err := recordedSteps(ctx, tx, opts.Schema)
	if err != nil {
		return nil, nil, err
	}
	known := map[int]bool{}
	for _, m := range All() {
		known[m.Version] = true
		if _, ok := recorded[m.Version]; ok || (limit > 0 && len(applied) == limit) {
			continue
		}
		if _, err := tx.Exec(ctx, m.SQL(opts.Schema)); err != nil {
			return nil, nil, fmt.Errorf("migrations: apply %04d_%s to schema %q: %w", m.Version, m.Name, opts.Schema, err)
		}
		if _, err := tx.Exec(ctx, "INSERT INTO "+pgsql.Table(opts.Schema, versionTable)+" (version, name) VALUES ($1, $2)", m.Version, m.Name); err != nil {
			return nil, nil, fmt.Errorf("migrations: record %04d_%s in schema %q: %w", m.Version, m.Name, opts.Schema, err)
		}
		applied = append(applied, m)
	}
	for v, r := range recorded {
		if !known[v] {
			unknown = append(unknown, Migration{Version: v, Name: r.name})
		}
	}
	sort.Slice(unknown, func(i, j int) bool { return unknown[i].Version < unknown[j].Version })
	return applied, unknown, nil
}

// Statuses lists every known migration and when it was applied in the schema, in version
// order. Steps recorded in the schema that this binary does not know (a newer onceflow
// applied them) are listed too, with Unknown set.
func Statuses(ctx context.Context, db DB, opts Options) ([]Status, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	statuses, _, err := readStatuses(ctx, db, opts.Schema)
	return statuses, err
}

// ErrNotMigrated is what a *NotMigratedError matches with errors.Is: the schema lacks steps
// this binary needs. (The value lives in internal/pgsql, so the engines below the public
// packages can recognise it too.)
var ErrNotMigrated = pgsql.ErrNotMigrated

// NotMigratedError is Validate's report of a schema that lacks steps this binary needs. Its
// message names the steps and the command to run, so a service can return it as is.
type NotMigratedError struct {
	// Schema is the schema that was checked.
	Schema string
	// Pending lists the steps this binary has that the schema lacks, in version order.
	Pending []Migration
	// Unknown lists steps the schema has that this binary does not know (a newer onceflow
	// applied them), in version order; usually empty.
	Unknown []Status
	// NeverMigrated is true when the schema has no version table at all.
	NeverMigrated bool
}

// Error says what is missing and what to run.
func (e *NotMigratedError) Error() string {
	var b strings.Builder
	if e.NeverMigrated {
		fmt.Fprintf(&b, "migrations: schema %q has never been migrated (it has no %s table)", e.Schema, versionTable)
	} else {
		fmt.Fprintf(&b, "migrations: schema %q is not migrated", e.Schema)
	}
	fmt.Fprintf(&b, ": %d of %d steps pending (%s)", len(e.Pending), len(All()), stepList(e.Pending))
	if len(e.Unknown) > 0 {
		ms := make([]Migration, len(e.Unknown))
		for i, s := range e.Unknown {
			ms[i] = s.Migration
		}
		fmt.Fprintf(&b, ", and it has steps this binary does not know (%s), applied by a newer onceflow", stepList(ms))
	}
	fmt.Fprintf(&b, "; run `onceflow migrate up --schema %s` (or migrations.Up from Go) before starting", e.Schema)
	return b.String()
}

// Unwrap makes errors.Is(err, ErrNotMigrated) true.
func (e *NotMigratedError) Unwrap() error { return ErrNotMigrated }

func stepList(ms []Migration) string {
	names := make([]string, len(ms))
	for i, m := range ms {
		names[i] = fmt.Sprintf("%04d_%s", m.Version, m.Name)
	}
	return strings.Join(names, ", ")
}

// Validate reports whether the schema has every step this binary embeds: nil when it has, a
// *NotMigratedError (errors.Is ErrNotMigrated) naming the pending steps and the command to run
// when it has not, or another error when the schema could not be read. It only reads and
// takes no lock; call it at start-up, before using the tables.
//
// Steps newer than this binary (recorded in the schema, unknown here) are not an error: they
// are logged as a warning on opts.Logger and listed by Statuses with Unknown set. That is
// what a rolling deploy needs, where the new release migrates while old processes still run
// or restart; onceflow's steps only add tables, columns and indexes, so an older release keeps
// working on a newer schema. (Flyway's validate ignores such "future" migrations by default
// for the same reason.) Callers that want to refuse instead can check Statuses for Unknown.
func Validate(ctx context.Context, db DB, opts Options) error {
	opts, err := opts.withDefaults()
	if err != nil {
		return err
	}
	statuses, exists, err := readStatuses(ctx, db, opts.Schema)
	if err != nil {
		return err
	}
	nm := &NotMigratedError{Schema: opts.Schema, NeverMigrated: !exists}
	for _, s := range statuses {
		switch {
		case s.Unknown:
			nm.Unknown = append(nm.Unknown, s)
		case s.AppliedAt == nil:
			nm.Pending = append(nm.Pending, s.Migration)
		}
	}
	if len(nm.Pending) > 0 {
		return nm
	}
	unknown := make([]Migration, len(nm.Unknown))
	for i, s := range nm.Unknown {
		unknown[i] = s.Migration
	}
	warnUnknown(opts, unknown)
	return nil
}

// warnUnknown logs the steps recorded in the schema that this binary does not embed.
func warnUnknown(opts Options, unknown []Migration) {
	for _, m := range unknown {
		opts.Logger.Warn("schema has a migration this binary does not know: a newer onceflow applied it; upgrade this binary",
			"schema", opts.Schema, "version", m.Version, "name", m.Name)
	}
}

// readStatuses reads the version table (if any) and merges it with the embedded steps.
func readStatuses(ctx context.Context, db DB, schema string) (statuses []Status, exists bool, err error) {
	// Check for the table first: querying a missing table would abort a caller's transaction.
	if err := db.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", pgsql.Table(schema, versionTable)).Scan(&exists); err != nil {
		return nil, false, fmt.Errorf("migrations: read the status of schema %q: %w", schema, err)
	}
	recorded := map[int]recordedStep{}
	if exists {
		if recorded, err = recordedSteps(ctx, db, schema); err != nil {
			return nil, true, err
		}
	}
	for _, m := range All() {
		s := Status{Migration: m}
		if r, ok := recorded[m.Version]; ok {
			s.AppliedAt = &r.at
			delete(recorded, m.Version)
		}
		statuses = append(statuses, s)
	}
	for v, r := range recorded { // what is left is unknown to this binary
		statuses = append(statuses, Status{Migration: Migration{Version: v, Name: r.name}, AppliedAt: &r.at, Unknown: true})
	}
	sort.Slice(statuses, func(i, j int) bool { return statuses[i].Version < statuses[j].Version })
	return statuses, exists, nil
}

// recordedStep is one row of the version table.
type recordedStep struct {
	name string
	at   time.Time
}

func recordedSteps(ctx context.Context, db DB, schema string) (map[int]recordedStep, error) {
	rows, err := db.Query(ctx, "SELECT version, name, applied_at FROM "+pgsql.Table(schema, versionTable))
	if err != nil {
		return nil, fmt.Errorf("migrations: read the applied steps of schema %q: %w", schema, err)
	}
	out := map[int]recordedStep{}
	var v int
	var r recordedStep
	if _, err := pgx.ForEachRow(rows, []any{&v, &r.name, &r.at}, func() error { out[v] = r; return nil }); err != nil {
		return nil, fmt.Errorf("migrations: read the applied steps of schema %q: %w", schema, err)
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
