package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/audit"
	"github.com/onceflow/onceflow/internal/pgsql"
)

// Admin reads and removes idempotency records, for operators (the console, scripts): did
// this POST run, what did it answer, until when is the answer replayed.
type Admin struct {
	schema string
	table  string
}

// NewAdmin returns an Admin for the records in schema ("" = "onceflow").
func NewAdmin(schema string) (*Admin, error) {
	if schema == "" {
		schema = pgsql.DefaultSchema
	}
	if err := pgsql.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("idempotency: %w", err)
	}
	return &Admin{schema: schema, table: pgsql.Table(schema, "idempotency_record")}, nil
}

// Record is one stored first response.
type Record struct {
	Owner string
	Key   string
	// Fingerprint is the SHA-256 of the first request's command (method, path, body, the
	// configured headers): a retry with another fingerprint is refused.
	Fingerprint []byte
	Status      int
	Headers     map[string][]string
	// Body is the stored response body, at most the maxBody Find was given (nil from List).
	Body []byte
	// Stored is false when the response exceeded the storage cap and was not kept: retries
	// are answered with a refusal instead of a replay.
	Stored    bool
	CreatedAt time.Time
	ExpiresAt time.Time
}

// DB is what Admin reads with: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
type DB interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// ErrNoRecord is returned by Find and DeleteTx for an owner and key without a record (never
// used, or expired and cleaned).
var ErrNoRecord = errors.New("idempotency: no record of this key")

const recordCols = `owner, idem_key, fingerprint, status, headers, substring(coalesce(body, ''::bytea) for $3), body IS NOT NULL, created_at, expires_at`

func scanRecord(row pgx.CollectableRow) (Record, error) {
	var rec Record
	err := row.Scan(&rec.Owner, &rec.Key, &rec.Fingerprint, &rec.Status, &rec.Headers, &rec.Body, &rec.Stored, &rec.CreatedAt, &rec.ExpiresAt)
	return rec, err
}

// Find returns the record of key under owner, its body cut at maxBody bytes (keys are
// scoped per owner: both are required). ErrNoRecord when there is none.
func (a *Admin) Find(ctx context.Context, db DB, owner, key string, maxBody int) (*Record, error) {
	if owner == "" || key == "" {
		return nil, errors.New("idempotency: keys are scoped per owner: give the owner and the key")
	}
	rows, err := db.Query(ctx, `SELECT `+recordCols+` FROM `+a.table+` WHERE owner = $1 AND idem_key = $2`, owner, key, maxBody)
	if err != nil {
		return nil, a.wrap("find a record", err)
	}
	recs, err := pgx.CollectRows(rows, scanRecord)
	if err != nil {
		return nil, a.wrap("find a record", err)
	}
	if len(recs) == 0 {
		return nil, fmt.Errorf("%w %q of owner %q", ErrNoRecord, key, owner)
	}
	return &recs[0], nil
}

// MaxListLimit caps one page of List.
const MaxListLimit = 1000

// List returns owner's records in key order after the key after ("" from the first), at
// most limit (1 to MaxListLimit), without their headers and bodies: a range of the primary
// key (owner, idem_key).
func (a *Admin) List(ctx context.Context, db DB, owner, after string, limit int) ([]Record, error) {
	if owner == "" {
		return nil, errors.New("idempotency: keys are scoped per owner: give the owner")
	}
	if limit < 1 || limit > MaxListLimit {
		return nil, fmt.Errorf("idempotency: limit %d is not between 1 and %d", limit, MaxListLimit)
	}
	rows, err := db.Query(ctx, `SELECT owner, idem_key, fingerprint, status, '{}'::jsonb, ''::bytea, body IS NOT NULL, created_at, expires_at
		FROM `+a.table+` WHERE owner = $1 AND idem_key > $2 ORDER BY idem_key LIMIT $3`, owner, after, limit)
	if err != nil {
		return nil, a.wrap("list records", err)
	}
	recs, err := pgx.CollectRows(rows, scanRecord)
	if err != nil {
		return nil, a.wrap("list records", err)
	}
	return recs, nil
}

// DeleteTx removes the record of key under owner in tx, so the next request with the key runs
// as a first one, and records the deletion in the audit trail (package audit) in tx.
// ErrNoRecord when there is none.
func (a *Admin) DeleteTx(ctx context.Context, tx pgx.Tx, owner, key string) error {
	if owner == "" || key == "" {
		return errors.New("idempotency: keys are scoped per owner: give the owner and the key")
	}
	tag, err := tx.Exec(ctx, `DELETE FROM `+a.table+` WHERE owner = $1 AND idem_key = $2`, owner, key)
	if err != nil {
		return a.wrap("delete a record", err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%w %q of owner %q; nothing was deleted", ErrNoRecord, key, owner)
	}
	if err := audit.RecordTx(audit.WithFilter(ctx, "owner "+owner), tx, a.schema, audit.IdempotencyDelete, []string{owner + " " + key}, "deleted"); err != nil {
		return a.wrap("record the deletion", err)
	}
	return nil
}

func (a *Admin) wrap(what string, err error) error {
	if pgsql.IsUndefinedTable(err) {
		return fmt.Errorf("idempotency: %s: schema %q is not migrated; run `onceflow migrate up --schema %s`: %w", what, a.schema, a.schema, err)
	}
	return fmt.Errorf("idempotency: %s in schema %q: %w", what, a.schema, err)
}

// Expired counts the records past their expiry that the Cleaner would delete now, up to max:
// the retention backlog, on the expires_at index.
func (a *Admin) Expired(ctx context.Context, db DB, max int64) (int64, error) {
	if max < 1 {
		return 0, fmt.Errorf("idempotency: an expired count needs a cap of at least 1, got %d", max)
	}
	rows, err := db.Query(ctx, `SELECT count(*) FROM (SELECT 1 FROM `+a.table+` WHERE expires_at <= now() LIMIT $1) s`, max)
	if err != nil {
		return 0, a.wrap("count expired records", err)
	}
	n, err := pgx.CollectExactlyOneRow(rows, pgx.RowTo[int64])
	if err != nil {
		return 0, a.wrap("count expired records", err)
	}
	return n, nil
}
