package inbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/migrations"
)

// ClaimTx records keys as processed by this consumer, as part of tx, in one statement, and
// reports for each key whether it was new: claimed[i] is true when keys[i] was not recorded
// before, so the caller applies that message's effect in tx; false means a duplicate (a key
// given twice in one call is new at most once, at its first position). The records commit or
// roll back with tx, together with the effects: that is the exactly-once guarantee.
//
// A key recorded by a concurrent transaction that has not finished yet makes ClaimTx wait for
// it: if it commits the key is a duplicate here, if it rolls back the key is claimed here. So
// two deliveries of one message never both see it as new.
//
// It is the core the middleware, the saga orchestrator and a batched consumer are built on;
// use it directly for a consumer that is not a Watermill handler. Keys come from KeyFunc,
// EventKey or SagaKey; an empty, overlong, non-UTF-8 or NUL-containing key is refused with an
// error wrapping ErrNoKey and nothing is recorded.
func (ib *Inbox) ClaimTx(ctx context.Context, tx pgx.Tx, keys ...string) (claimed []bool, err error) {
	claimed, err = ib.run.ClaimTx(ctx, tx, keys...)
	if err != nil {
		return nil, ib.dbError(fmt.Sprintf("record %d dedup keys", len(keys)), err)
	}
	return claimed, nil
}

// SeenTx reports whether key is recorded for this consumer: committed by an earlier
// transaction, or claimed earlier in tx. It records nothing. A key that a concurrent
// transaction claimed but has not committed is not seen (PostgreSQL's READ COMMITTED
// snapshot), so SeenTx suits checks that a later ClaimTx in the same transaction settles —
// such as the saga barrier, which looks for a step's compensation before running its
// action and then claims the action's key; deciding "skip" from SeenTx alone is only safe for
// keys whose writer has certainly finished.
func (ib *Inbox) SeenTx(ctx context.Context, tx pgx.Tx, key string) (bool, error) {
	seen, err := ib.run.SeenTx(ctx, tx, key)
	if err != nil {
		return false, ib.dbError(fmt.Sprintf("look up dedup key %q", key), err)
	}
	return seen, nil
}

// CheckSchema reports whether the inbox's schema is fully migrated (migrations.Validate): nil,
// or an error wrapping migrations.ErrNotMigrated that lists the missing steps and names the
// command to run. Call it at start-up, before the router runs, to fail fast instead of on the
// first message.
func (ib *Inbox) CheckSchema(ctx context.Context) error {
	return migrations.Validate(ctx, ib.cfg.Pool, migrations.Options{Schema: ib.cfg.Schema, Logger: ib.cfg.Logger})
}

// dbError wraps a failed statement; a missing table means an unmigrated schema, which the
// error says how to fix.
func (ib *Inbox) dbError(what string, err error) error {
	if pgsql.IsUndefinedTable(err) {
		return fmt.Errorf("inbox: consumer %q: %s: %w: schema %q lacks a table of this onceflow version; run `onceflow migrate up --schema %s` (or migrations.Up) before starting consumers: %w",
			ib.cfg.Consumer, what, migrations.ErrNotMigrated, ib.cfg.Schema, ib.cfg.Schema, err)
	}
	if errors.Is(err, ErrNoKey) {
		return err // says which key, and that no retry can fix it
	}
	return fmt.Errorf("inbox: consumer %q: %s: %w", ib.cfg.Consumer, what, err)
}
