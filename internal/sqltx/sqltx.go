// Package sqltx lets one statement builder run on either kind of transaction a service may
// hold: a pgx.Tx, or a database/sql *sql.Tx from any PostgreSQL driver (pgx's stdlib, lib/pq).
//
// The SQL text is the same for both; only the arguments differ in encoding. pgx encodes Go
// slices as PostgreSQL arrays in the binary format. database/sql drivers do not agree on
// arrays (lib/pq wants pq.Array, pgx's stdlib takes slices), so Std sends every array as its
// text literal ('{"a","b"}'); the statements cast each array parameter ($2::uuid[]), so
// PostgreSQL parses the literal as the array type the pgx path sends in binary.
package sqltx

import (
	"context"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Row is one result row (pgx.Row and *sql.Row both have this method).
type Row interface {
	Scan(dest ...any) error
}

// Querier is what a transaction-bound write needs from the caller's transaction.
type Querier interface {
	// Exec runs sql and returns the number of rows it affected.
	Exec(ctx context.Context, sql string, args ...any) (int64, error)
	// QueryRow runs sql, which returns one row.
	QueryRow(ctx context.Context, sql string, args ...any) Row
}

// Pgx adapts a pgx transaction: arguments go to pgx unchanged.
func Pgx(tx pgx.Tx) Querier { return pgxQ{tx} }

type pgxQ struct{ tx pgx.Tx }

func (q pgxQ) Exec(ctx context.Context, sql string, args ...any) (int64, error) {
	tag, err := q.tx.Exec(ctx, sql, args...)
	return tag.RowsAffected(), err
}

func (q pgxQ) QueryRow(ctx context.Context, sql string, args ...any) Row {
	return q.tx.QueryRow(ctx, sql, args...)
}

// ErrNilTx is returned for a nil *sql.Tx.
var ErrNilTx = errors.New("the *sql.Tx is nil")

// Std adapts a database/sql transaction of any PostgreSQL driver. Arguments are re-encoded
// into what every driver accepts (see Arg).
func Std(tx *sql.Tx) Querier { return stdQ{tx} }

type stdQ struct{ tx *sql.Tx }

func (q stdQ) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	if q.tx == nil {
		return 0, ErrNilTx
	}
	res, err := q.tx.ExecContext(ctx, query, encode(args)...)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

func (q stdQ) QueryRow(ctx context.Context, query string, args ...any) Row {
	if q.tx == nil {
		return errRow{ErrNilTx}
	}
	return q.tx.QueryRowContext(ctx, query, encode(args)...)
}

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

func encode(args []any) []any {
	out := make([]any, len(args))
	for i, a := range args {
		out[i] = Arg(a)
	}
	return out
}

// Arg re-encodes one argument for a database/sql driver: string, int64 and bool slices and
// [][]byte become PostgreSQL array literals (text), json.RawMessage and maps become JSON
// text; everything else (string, []byte, int64, time.Time, named string types) is left to
// the driver, which every PostgreSQL driver encodes the same way.
func Arg(a any) any {
	switch v := a.(type) {
	case []string:
		return arrayLiteral(len(v), func(b *strings.Builder, i int) { quote(b, v[i]) })
	case []int64:
		return arrayLiteral(len(v), func(b *strings.Builder, i int) { b.WriteString(strconv.FormatInt(v[i], 10)) })
	case []int:
		return arrayLiteral(len(v), func(b *strings.Builder, i int) { b.WriteString(strconv.Itoa(v[i])) })
	case [][]byte:
		// bytea's hex input form (\x0a0b), quoted, with the backslash escaped for the array
		// parser.
		return arrayLiteral(len(v), func(b *strings.Builder, i int) {
			if v[i] == nil {
				b.WriteString("NULL")
				return
			}
			b.WriteString(`"\\x`)
			b.WriteString(hex.EncodeToString(v[i]))
			b.WriteByte('"')
		})
	case json.RawMessage:
		if v == nil {
			return nil
		}
		return string(v)
	case map[string]string:
		if v == nil {
			return nil
		}
		out, err := json.Marshal(v)
		if err != nil {
			return a // cannot happen for map[string]string
		}
		return string(out)
	}
	return a
}

func arrayLiteral(n int, elem func(*strings.Builder, int)) string {
	var b strings.Builder
	b.WriteByte('{')
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		elem(&b, i)
	}
	b.WriteByte('}')
	return b.String()
}

// quote writes s as a double-quoted array element, escaping " and \.
func quote(b *strings.Builder, s string) {
	b.WriteByte('"')
	for _, r := range s {
		if r == '"' || r == '\\' {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	b.WriteByte('"')
}

// SQLState returns the SQLSTATE code of a database error from pgx (pgconn.PgError), from
// lib/pq (pq.Error) or from any driver whose errors have a SQLState method, or "".
func SQLState(err error) string {
	var s interface{ SQLState() string }
	if errors.As(err, &s) {
		return s.SQLState()
	}
	return ""
}
