// Package pgsql holds small SQL helpers shared by onceflow's packages.
package pgsql

import (
	"errors"
	"fmt"
	"regexp"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DefaultSchema is the schema onceflow's tables live in unless configured otherwise.
const DefaultSchema = "onceflow"

var plainIdent = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// ErrNotMigrated is migrations.ErrNotMigrated: the schema lacks migration steps this binary
// needs. No retry helps until someone migrates it.
var ErrNotMigrated = errors.New("migrations: schema is not migrated")

// ValidateSchema accepts only plain lower-case identifiers (letters, digits, underscore,
// not starting with a digit, at most 63 bytes). Anything else is refused rather than quoted
// into existence, so a typo or an injection attempt never creates a surprising schema.
func ValidateSchema(name string) error {
	if !plainIdent.MatchString(name) {
		return fmt.Errorf("invalid schema name %q: use a plain identifier of lower-case letters, digits and underscores, starting with a letter or underscore, at most 63 characters (e.g. %q)", name, DefaultSchema)
	}
	return nil
}

// Ident quotes one identifier for SQL text. Names are validated before they get here;
// quoting anyway keeps reserved words such as "user" working.
func Ident(name string) string { return pgx.Identifier{name}.Sanitize() }

// Table returns schema.table, both quoted.
func Table(schema, table string) string { return pgx.Identifier{schema, table}.Sanitize() }

// UniqueViolation is the SQLSTATE of a unique constraint violation.
const UniqueViolation = "23505"

// IsUniqueViolation reports whether err is a unique violation; when constraint is not empty it
// must also be the violated constraint's name.
func IsUniqueViolation(err error, constraint string) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != UniqueViolation {
		return false
	}
	return constraint == "" || pgErr.ConstraintName == constraint
}

// UndefinedTable is the SQLSTATE of a statement naming a table that does not exist.
const UndefinedTable = "42P01"

// IsUndefinedTable reports whether err is PostgreSQL's "relation does not exist": in onceflow
// that almost always means the schema was never migrated.
func IsUndefinedTable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == UndefinedTable
}

// UndefinedColumn is the SQLSTATE of a statement naming a column that does not exist.
const UndefinedColumn = "42703"

// IsUndefinedColumn reports whether err is PostgreSQL's "column does not exist": in onceflow,
// a schema migrated by an older release.
func IsUndefinedColumn(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == UndefinedColumn
}
