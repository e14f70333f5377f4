// Package audit is the operators' audit trail: every operator action — a saga retry,
// compensation or upgrade request, an outbox replay, an inbox poison replay or deletion, a
// release of the inbox's retry lane, the deletion of an idempotency record — is recorded in
// the operator_action table (migration 0018) by the Admin call that carries it out, in the
// same transaction: an action that rolled back leaves no record, one that committed always
// has one.
//
// Who acted comes from the context (WithActor): the console puts the authenticated name
// there, the onceflow CLI "cli:" and the OS user; a service calling the Admin APIs itself
// may set its own, else the record says "service".
package audit

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/internal/pgsql"
)

// The actions recorded, one name each across the packages.
const (
	SagaRetry      = "saga retry"
	SagaCompensate = "saga compensate"
	SagaUpgrade    = "saga upgrade"
	OutboxReplay   = "outbox replay"
	InboxReplay    = "inbox replay"
	InboxDelete    = "inbox delete"
	// InboxRelease makes heads of the inbox's retry lane due now (inbox.Admin.ReleaseTx); its
	// targets are inbox_parked row ids.
	InboxRelease = "inbox release"
	// IdempotencyDelete's target is "<owner> <key>".
	IdempotencyDelete = "idempotency delete"
)

// Entry is one recorded action.
type Entry struct {
	ID     int64
	At     time.Time // the database's clock, when the action's transaction wrote it
	Actor  string
	Action string
	// Targets are what was acted on: saga ids, event ids, or inbox poison row ids.
	Targets []string
	// Filter is the filter the targets were selected by ("" for an action on named ids).
	Filter string
	// Outcome says what was done, e.g. "requested" or "rows moved back to the outbox: 3".
	Outcome string
}

type actorKey struct{}
type filterKey struct{}

// WithActor returns ctx carrying who acts: the Admin calls made with it record that name.
func WithActor(ctx context.Context, actor string) context.Context {
	return context.WithValue(ctx, actorKey{}, actor)
}

// ActorFrom is the name WithActor put in ctx, or "service".
func ActorFrom(ctx context.Context) string {
	if a, ok := ctx.Value(actorKey{}).(string); ok && a != "" {
		return a
	}
	return "service"
}

// WithFilter returns ctx carrying the filter a bulk action selected its targets by, for the
// records of the actions made with it.
func WithFilter(ctx context.Context, filter string) context.Context {
	return context.WithValue(ctx, filterKey{}, filter)
}

func filterFrom(ctx context.Context) string {
	f, _ := ctx.Value(filterKey{}).(string)
	return f
}

// Execer is what RecordTx writes with: a pgx.Tx, or a pgx.Batch's queue (BatchTx).
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// RecordTx records action on targets with outcome in tx, the transaction of the action, with
// the actor and the filter ctx carries. schema is the onceflow schema ("" for the default).
func RecordTx(ctx context.Context, tx Execer, schema, action string, targets []string, outcome string) error {
	if schema == "" {
		schema = pgsql.DefaultSchema
	}
	if targets == nil {
		targets = []string{}
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+pgsql.Table(schema, "operator_action")+` (actor, action, targets, filter, outcome) VALUES ($1, $2, $3, $4, $5)`,
		ActorFrom(ctx), action, targets, filterFrom(ctx), outcome); err != nil {
		return fmt.Errorf("audit: record %s: %w", action, err)
	}
	return nil
}

// DB is what List reads with: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
type DB interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Filter selects records for List. The zero Filter is the newest records.
type Filter struct {
	// Target selects the records of actions on this saga id, event id or poison row id;
	// Actions, when set, only the records of these actions (a saga's, say, so a poison row
	// whose id is the same text is not taken for it).
	Target  string
	Actions []string
	// Before continues a listing: records with an id below it.
	Before int64
	// Limit is the page size: default 100, at most 1000.
	Limit int
}

// List returns records newest first, by the primary key (or the targets index).
func List(ctx context.Context, db DB, schema string, f Filter) ([]Entry, error) {
	if schema == "" {
		schema = pgsql.DefaultSchema
	}
	switch {
	case f.Limit == 0:
		f.Limit = 100
	case f.Limit < 0 || f.Limit > 1000:
		return nil, fmt.Errorf("audit: limit %d is not between 1 and 1000", f.Limit)
	}
	where, args := `($1 = 0 OR id < $1)`, []any{f.Before, f.Limit}
	if f.Target != "" {
		args = append(args, f.Target)
		where += ` AND targets @> ARRAY[$` + strconv.Itoa(len(args)) + `::text]` // operator_action_targets_idx
	}
	if len(f.Actions) > 0 {
		args = append(args, f.Actions)
		where += ` AND action = ANY($` + strconv.Itoa(len(args)) + `::text[])`
	}
	rows, err := db.Query(ctx, `SELECT id, at, actor, action, targets, filter, outcome FROM `+pgsql.Table(schema, "operator_action")+`
		WHERE `+where+` ORDER BY id DESC LIMIT $2`, args...)
	if err != nil {
		return nil, fmt.Errorf("audit: read the operator actions: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Entry, error) {
		var e Entry
		err := r.Scan(&e.ID, &e.At, &e.Actor, &e.Action, &e.Targets, &e.Filter, &e.Outcome)
		return e, err
	})
	if err != nil {
		return nil, fmt.Errorf("audit: read the operator actions: %w", err)
	}
	return out, nil
}
