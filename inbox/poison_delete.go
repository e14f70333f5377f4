package inbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/audit"
	"github.com/onceflow/onceflow/internal/pgsql"
)

// DeleteFilter selects the poison rows DeletePoisonTx removes: the rows IDs names (of
// Consumer, when set), or else the rows of Consumer (required then: a delete never takes
// every consumer's rows) whose error contains ErrorContains, oldest first, at most Limit.
type DeleteFilter struct {
	IDs           []int64
	Consumer      string
	ErrorContains string
	// Limit bounds a delete by filter: default and maximum MaxDeleteLimit.
	Limit int
}

// MaxDeleteLimit bounds one delete by filter; a larger cleanup is several, each recorded.
const MaxDeleteLimit = 10_000

// ErrEmptyDeleteFilter is returned for a DeleteFilter with neither ids nor a consumer.
var ErrEmptyDeleteFilter = errors.New("inbox: delete poison rows: name the rows (ids) or their consumer; a delete never takes every consumer's rows")

// DeletePoisonTx deletes the poison rows f selects in tx, records the deletion in the audit
// trail (package audit) in the same transaction, and returns the ids deleted, in id order.
// A row is only deleted, never replayed: its dedup row stays, so a redelivery of the message
// is still skipped. By ids, the caller compares what was deleted with what it named (and
// rolls back when a row is missing, if it wants all or nothing).
func DeletePoisonTx(ctx context.Context, tx pgx.Tx, schema string, f DeleteFilter) ([]int64, error) {
	if schema == "" {
		schema = pgsql.DefaultSchema
	}
	if err := pgsql.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("inbox: delete poison rows: %w", err)
	}
	if len(f.IDs) == 0 && f.Consumer == "" {
		return nil, ErrEmptyDeleteFilter
	}
	switch {
	case f.Limit == 0:
		f.Limit = MaxDeleteLimit
	case f.Limit < 0 || f.Limit > MaxDeleteLimit:
		return nil, fmt.Errorf("inbox: delete poison rows: limit %d is not between 1 and %d", f.Limit, MaxDeleteLimit)
	}
	table := pgsql.Table(schema, "inbox_poison")
	var rows pgx.Rows
	var err error
	if len(f.IDs) > 0 {
		rows, err = tx.Query(ctx, `DELETE FROM `+table+` WHERE id = ANY($1) AND ($2 = '' OR consumer = $2) RETURNING id`, f.IDs, f.Consumer)
	} else {
		// On inbox_poison_consumer_idx (consumer, id).
		rows, err = tx.Query(ctx, `DELETE FROM `+table+` WHERE id IN (SELECT id FROM `+table+`
			WHERE consumer = $1 AND ($2 = '' OR strpos(lower(error), lower($2)) > 0) ORDER BY id LIMIT $3) RETURNING id`, f.Consumer, f.ErrorContains, f.Limit)
	}
	if err != nil {
		return nil, poisonDBError(schema, "delete poison rows", err)
	}
	deleted, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, poisonDBError(schema, "delete poison rows", err)
	}
	if len(deleted) == 0 {
		return nil, nil
	}
	targets := make([]string, len(deleted))
	for i, id := range deleted {
		targets[i] = strconv.FormatInt(id, 10)
	}
	if err := audit.RecordTx(audit.WithFilter(ctx, f.describe()), tx, schema, audit.InboxDelete, targets, fmt.Sprintf("poison rows deleted: %d", len(deleted))); err != nil {
		return nil, poisonDBError(schema, "record the deletion", err)
	}
	return deleted, nil
}

func (f DeleteFilter) describe() string {
	return describePoison(f.IDs, f.Consumer, time.Time{}, f.ErrorContains, "")
}

func poisonDBError(schema, what string, err error) error {
	if pgsql.IsUndefinedColumn(err) || pgsql.IsUndefinedTable(err) {
		return fmt.Errorf("inbox: %s: schema %q is not migrated; run `onceflow migrate up --schema %s`: %w", what, schema, schema, err)
	}
	return fmt.Errorf("inbox: %s: %w", what, err)
}
