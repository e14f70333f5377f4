package inbox

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/audit"
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
// rolls back when a row is missing, if it wants all or nothing). By filter it deletes the
// rows CountPoison counts for the same consumer, error text and Limit.
func (a *Admin) DeletePoisonTx(ctx context.Context, tx pgx.Tx, f DeleteFilter) ([]int64, error) {
	if len(f.IDs) == 0 && f.Consumer == "" {
		return nil, ErrEmptyDeleteFilter
	}
	switch {
	case f.Limit == 0:
		f.Limit = MaxDeleteLimit
	case f.Limit < 0 || f.Limit > MaxDeleteLimit:
		return nil, fmt.Errorf("inbox: delete poison rows: limit %d is not between 1 and %d", f.Limit, MaxDeleteLimit)
	}
	var rows pgx.Rows
	var err error
	if len(f.IDs) > 0 {
		rows, err = tx.Query(ctx, `DELETE FROM `+a.poison+` WHERE id = ANY($1) AND ($2 = '' OR consumer = $2) RETURNING id`, f.IDs, f.Consumer)
	} else {
		w := &where{}
		sel := a.poisonSelection(w, f.Consumer, f.ErrorContains)
		rows, err = tx.Query(ctx, `DELETE FROM `+a.poison+` WHERE id IN (`+sel+` LIMIT `+w.arg(f.Limit)+`) RETURNING id`, w.args...)
	}
	if err != nil {
		return nil, a.wrap("delete poison rows", err)
	}
	deleted, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, a.wrap("delete poison rows", err)
	}
	if len(deleted) == 0 {
		return nil, nil
	}
	slices.Sort(deleted) // RETURNING follows no order
	targets := make([]string, len(deleted))
	for i, id := range deleted {
		targets[i] = strconv.FormatInt(id, 10)
	}
	if err := audit.RecordTx(audit.WithFilter(ctx, f.describe()), tx, a.schema, audit.InboxDelete, targets, fmt.Sprintf("poison rows deleted: %d", len(deleted))); err != nil {
		return nil, a.wrap("record the deletion", err)
	}
	return deleted, nil
}

func (f DeleteFilter) describe() string {
	return describePoison(f.IDs, f.Consumer, time.Time{}, f.ErrorContains, "")
}
