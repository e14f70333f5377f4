package inbox

import (
	"context"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

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
	for i, k := range keys {
		if _, err := checkKey(k); err != nil {
			return nil, fmt.Errorf("inbox: consumer %q: key %d: %w", ib.cfg.Consumer, i, err)
		}
	}
	switch len(keys) {
	case 0:
		return nil, nil
	case 1: // the middleware's path: the plain statement is the cheapest
		tag, err := tx.Exec(ctx, ib.claimOneSQL, ib.cfg.Consumer, keys[0])
		if err != nil {
			return nil, ib.dbError(fmt.Sprintf("record dedup key %q", keys[0]), err)
		}
		return []bool{tag.RowsAffected() == 1}, nil
	}
	rows, err := tx.Query(ctx, ib.claimManySQL, ib.cfg.Consumer, distinctSorted(keys))
	if err != nil {
		return nil, ib.dbError(fmt.Sprintf("record %d dedup keys", len(keys)), err)
	}
	inserted, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, ib.dbError(fmt.Sprintf("record %d dedup keys", len(keys)), err)
	}
	return claimedOf(keys, inserted), nil
}

// distinctSorted: two batches claiming overlapping keys lock them in the same order, so they
// wait for each other instead of deadlocking.
func distinctSorted(keys []string) []string {
	distinct := slices.Clone(keys)
	slices.Sort(distinct)
	return slices.Compact(distinct)
}

// claimedOf says for each key whether it is among the inserted ones; a repeated key is new
// only at its first position.
func claimedOf(keys, inserted []string) []bool {
	fresh := make(map[string]bool, len(inserted))
	for _, k := range inserted {
		fresh[k] = true
	}
	claimed := make([]bool, len(keys))
	for i, k := range keys {
		claimed[i] = fresh[k]
		delete(fresh, k)
	}
	return claimed
}

// QueueClaimMany is ClaimTx for a caller that pipelines the claim with its own statements in
// one round trip (tx.SendBatch(ctx, b)): once the batch has run, (*claimed)[i] says whether
// keys[i] was new. Statements queued after it run after it, so they see its rows (and have
// waited for concurrent claims of the same keys). The keys are checked now: a malformed one
// is refused with ErrNoKey and nothing is queued.
func (ib *Inbox) QueueClaimMany(b *pgx.Batch, keys []string, claimed *[]bool) error {
	for i, k := range keys {
		if _, err := checkKey(k); err != nil {
			return fmt.Errorf("inbox: consumer %q: key %d: %w", ib.cfg.Consumer, i, err)
		}
	}
	if len(keys) == 1 { // a batch of one: the plain statement is the cheapest
		b.Queue(ib.claimOneSQL, ib.cfg.Consumer, keys[0]).Exec(func(tag pgconn.CommandTag) error {
			*claimed = []bool{tag.RowsAffected() == 1}
			return nil
		})
		return nil
	}
	b.Queue(ib.claimManySQL, ib.cfg.Consumer, distinctSorted(keys)).Query(func(rows pgx.Rows) error {
		inserted, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return ib.dbError(fmt.Sprintf("record %d dedup keys", len(keys)), err)
		}
		*claimed = claimedOf(keys, inserted)
		return nil
	})
	return nil
}

// QueueSeenMany is SeenManyTx queued into b; see QueueClaimMany.
func (ib *Inbox) QueueSeenMany(b *pgx.Batch, keys []string, seen *[]bool) error {
	for i, k := range keys {
		if _, err := checkKey(k); err != nil {
			return fmt.Errorf("inbox: consumer %q: key %d: %w", ib.cfg.Consumer, i, err)
		}
	}
	if len(keys) == 1 { // a batch of one: the plain statement is the cheapest
		b.Queue(ib.seenSQL, ib.cfg.Consumer, keys[0]).QueryRow(func(row pgx.Row) error {
			var found bool
			if err := row.Scan(&found); err != nil {
				return ib.dbError(fmt.Sprintf("look up dedup key %q", keys[0]), err)
			}
			*seen = []bool{found}
			return nil
		})
		return nil
	}
	b.Queue(ib.seenManySQL, ib.cfg.Consumer, keys).Query(func(rows pgx.Rows) error {
		found, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return ib.dbError(fmt.Sprintf("look up %d dedup keys", len(keys)), err)
		}
		*seen = seenOf(keys, found)
		return nil
	})
	return nil
}

// SeenTx reports whether key is recorded for this consumer: committed by an earlier
// transaction, or claimed earlier in tx. It records nothing. A key that a concurrent
// transaction claimed but has not committed is not seen (PostgreSQL's READ COMMITTED
// snapshot), so SeenTx suits checks that a later ClaimTx in the same transaction settles —
// such as the saga barrier, which looks for a step's compensation before running its
// action and then claims the action's key; deciding "skip" from SeenTx alone is only safe for
// keys whose writer has certainly finished.
func (ib *Inbox) SeenTx(ctx context.Context, tx pgx.Tx, key string) (bool, error) {
	if _, err := checkKey(key); err != nil {
		return false, fmt.Errorf("inbox: consumer %q: %w", ib.cfg.Consumer, err)
	}
	var seen bool
	if err := tx.QueryRow(ctx, ib.seenSQL, ib.cfg.Consumer, key).Scan(&seen); err != nil {
		return false, ib.dbError(fmt.Sprintf("look up dedup key %q", key), err)
	}
	return seen, nil
}

// SeenManyTx is SeenTx for many keys in one statement: seen[i] reports whether keys[i] is
// recorded for this consumer.
func (ib *Inbox) SeenManyTx(ctx context.Context, tx pgx.Tx, keys ...string) (seen []bool, err error) {
	for i, k := range keys {
		if _, err := checkKey(k); err != nil {
			return nil, fmt.Errorf("inbox: consumer %q: key %d: %w", ib.cfg.Consumer, i, err)
		}
	}
	if len(keys) == 0 {
		return nil, nil
	}
	rows, err := tx.Query(ctx, ib.seenManySQL, ib.cfg.Consumer, keys)
	if err != nil {
		return nil, ib.dbError(fmt.Sprintf("look up %d dedup keys", len(keys)), err)
	}
	found, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, ib.dbError(fmt.Sprintf("look up %d dedup keys", len(keys)), err)
	}
	return seenOf(keys, found), nil
}

// seenOf says for each key whether it is among the found ones.
func seenOf(keys, found []string) []bool {
	set := make(map[string]bool, len(found))
	for _, k := range found {
		set[k] = true
	}
	seen := make([]bool, len(keys))
	for i, k := range keys {
		seen[i] = set[k]
	}
	return seen
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
		return fmt.Errorf("inbox: consumer %q: %s: %w: schema %q has no processed_event table; run `onceflow migrate up --schema %s` (or migrations.Up) before starting consumers: %w",
			ib.cfg.Consumer, what, migrations.ErrNotMigrated, ib.cfg.Schema, ib.cfg.Schema, err)
	}
	return fmt.Errorf("inbox: consumer %q: %s: %w", ib.cfg.Consumer, what, err)
}

// QueueClaim queues the claim of one key into b, for a caller that pipelines it with its own
// statements in one round trip (tx.SendBatch(ctx, b)); once the batch has run, *claimed
// reports whether the key was new, as ClaimTx would. The key is checked now: a malformed one
// is refused with ErrNoKey and nothing is queued.
func (ib *Inbox) QueueClaim(b *pgx.Batch, key string, claimed *bool) error {
	if _, err := checkKey(key); err != nil {
		return fmt.Errorf("inbox: consumer %q: %w", ib.cfg.Consumer, err)
	}
	b.Queue(ib.claimOneSQL, ib.cfg.Consumer, key).Exec(func(tag pgconn.CommandTag) error {
		*claimed = tag.RowsAffected() == 1
		return nil
	})
	return nil
}

// QueueSeen queues SeenTx's lookup of key into b; once the batch has run, *seen reports
// whether the key is recorded. Like SeenTx it records nothing and does not wait for
// uncommitted claims of other transactions.
func (ib *Inbox) QueueSeen(b *pgx.Batch, key string, seen *bool) error {
	if _, err := checkKey(key); err != nil {
		return fmt.Errorf("inbox: consumer %q: %w", ib.cfg.Consumer, err)
	}
	b.Queue(ib.seenSQL, ib.cfg.Consumer, key).QueryRow(func(row pgx.Row) error { return row.Scan(seen) })
	return nil
}
