package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/internal/pgsql"
)

// MaxKeyBytes bounds a dedup key. The key is part of processed_event's primary key, and a
// B-tree entry must fit in a third of a page; a longer key is refused rather than truncated,
// because truncation could make two different messages look like duplicates.
const MaxKeyBytes = 1024

// MaxConsumerBytes bounds a consumer's name, which is stored in every dedup row.
const MaxConsumerBytes = 200

// ErrNoKey is wrapped by the error returned for a message that has no usable dedup key (no
// UUID, incomplete saga metadata, or a KeyFunc error). Such a message is never processed
// without deduplication. Retrying it cannot help. (Re-exported as inbox.ErrNoKey.)
var ErrNoKey = errors.New("message has no usable dedup key")

// CheckKey refuses keys PostgreSQL cannot store or index: empty, NUL bytes, invalid UTF-8,
// too long. The error wraps ErrNoKey.
func CheckKey(key string) (string, error) {
	switch {
	case key == "":
		return "", fmt.Errorf("%w: the key is empty", ErrNoKey)
	case len(key) > MaxKeyBytes:
		return "", fmt.Errorf("%w: the key is %d bytes, over the %d-byte limit (use a shorter id, or a KeyFunc that hashes it)", ErrNoKey, len(key), MaxKeyBytes)
	case !utf8.ValidString(key):
		return "", fmt.Errorf("%w: the key is not valid UTF-8", ErrNoKey)
	case strings.IndexByte(key, 0) >= 0:
		return "", fmt.Errorf("%w: the key contains a NUL byte", ErrNoKey)
	}
	return key, nil
}

// CheckConsumer refuses a consumer name that cannot be stored in the dedup rows.
func CheckConsumer(c string) error {
	switch {
	case c == "":
		return errors.New(`Consumer is empty; name the consumer (e.g. "billing"): it is part of every dedup key and must stay stable`)
	case len(c) > MaxConsumerBytes:
		return fmt.Errorf("Consumer is %d bytes; use at most %d", len(c), MaxConsumerBytes)
	case !utf8.ValidString(c) || strings.IndexByte(c, 0) >= 0:
		return fmt.Errorf("Consumer %q is not valid UTF-8 text without NUL bytes", c)
	}
	return nil
}

// statements are the dedup and poison statements of one schema.
type statements struct {
	claimOne, claimMany, claimSaga, seenOne, seenMany, poison string
}

func newStatements(schema string) statements {
	table := pgsql.Table(schema, "processed_event")
	return statements{
		// ON CONFLICT DO NOTHING rather than catching a unique violation: an error would abort
		// the transaction, and a concurrent delivery of the same key waits here on the first
		// one's uncommitted row, then sees it (0 rows: skip) or inserts if the first rolled back.
		claimOne:  `INSERT INTO ` + table + ` (consumer, dedup_key) VALUES ($1, $2) ON CONFLICT DO NOTHING`,
		claimMany: `INSERT INTO ` + table + ` (consumer, dedup_key) SELECT $1, k FROM unnest($2::text[]) AS u(k) ON CONFLICT DO NOTHING RETURNING dedup_key`,
		// A saga's keys (a participant's barrier) carry their saga's id: retention keeps them
		// while the saga lives (migration 0015).
		claimSaga: `INSERT INTO ` + table + ` (consumer, dedup_key, saga_id) SELECT $1, u.k, u.s FROM unnest($2::text[], $3::text[]) AS u(k, s)` +
			` ON CONFLICT DO NOTHING RETURNING dedup_key`,
		seenOne: `SELECT EXISTS (SELECT 1 FROM ` + table + ` WHERE consumer = $1 AND dedup_key = $2)`,
		// One index probe per key, whatever the table's statistics: `dedup_key = ANY($2)` lets
		// a generic plan made while the table was small (pgx prepares each statement once per
		// connection) scan every row of the consumer for each lookup, until the next ANALYZE.
		seenMany: `SELECT u.k FROM unnest($2::text[]) AS u(k) CROSS JOIN LATERAL (SELECT 1 FROM ` + table +
			` WHERE consumer = $1 AND dedup_key = u.k LIMIT 1) AS hit`,
		poison: `INSERT INTO ` + pgsql.Table(schema, "inbox_poison") +
			` (consumer, dedup_key, message_uuid, source, metadata, payload, attempts, error, handler, publish_topic, replay_refusal, topic)` +
			` VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)`,
	}
}

// SeenManySQL is the statement QueueSeen sends for several keys (for plan tests).
func (r *Runner) SeenManySQL() string { return r.sql.seenMany }

func checkKeys(keys []string) error {
	for i, k := range keys {
		if _, err := CheckKey(k); err != nil {
			return fmt.Errorf("key %d: %w", i, err)
		}
	}
	return nil
}

// ClaimTx records keys as processed by the consumer, as part of tx, in one statement, and
// reports for each whether it was new (see inbox.Inbox.ClaimTx). A malformed key is refused
// with ErrNoKey and nothing is recorded.
func (r *Runner) ClaimTx(ctx context.Context, tx pgx.Tx, keys ...string) (claimed []bool, err error) {
	if err := checkKeys(keys); err != nil {
		return nil, fmt.Errorf("%s: %w", r.cfg.What, err)
	}
	switch len(keys) {
	case 0:
		return nil, nil
	case 1: // the middleware's path: the plain statement is the cheapest
		tag, err := tx.Exec(ctx, r.sql.claimOne, r.cfg.Consumer, keys[0])
		if err != nil {
			return nil, err
		}
		return []bool{tag.RowsAffected() == 1}, nil
	}
	rows, err := tx.Query(ctx, r.sql.claimMany, r.cfg.Consumer, distinctSorted(keys))
	if err != nil {
		return nil, err
	}
	inserted, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, err
	}
	return claimedOf(keys, inserted), nil
}

// distinctSorted: two batches claiming overlapping keys lock them in the same order, so they
// wait for each other instead of deadlocking.
func distinctSorted(keys []string) []string {
	return slices.Compact(slices.Sorted(slices.Values(keys)))
}

// QueueClaim is ClaimTx for a caller that pipelines the claim with its own statements in one
// round trip (tx.SendBatch(ctx, b)): once the batch has run, (*claimed)[i] says whether keys[i]
// was new. Statements queued after it run after it, so they see its rows (and have waited for
// concurrent claims of the same keys). The keys are checked now: a malformed one is refused
// with ErrNoKey and nothing is queued.
func (r *Runner) QueueClaim(b *pgx.Batch, keys []string, claimed *[]bool) error {
	if err := checkKeys(keys); err != nil {
		return fmt.Errorf("%s: %w", r.cfg.What, err)
	}
	if len(keys) == 1 { // the middleware's path: the plain statement is the cheapest
		b.Queue(r.sql.claimOne, r.cfg.Consumer, keys[0]).Exec(func(tag pgconn.CommandTag) error {
			*claimed = []bool{tag.RowsAffected() == 1}
			return nil
		})
		return nil
	}
	b.Queue(r.sql.claimMany, r.cfg.Consumer, distinctSorted(keys)).Query(func(rows pgx.Rows) error {
		inserted, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return err
		}
		*claimed = claimedOf(keys, inserted)
		return nil
	})
	return nil
}

// QueueClaimSaga is QueueClaim for keys that belong to sagas (a participant's barrier):
// sagaIDs[i] is the saga of keys[i], kept with its row so that retention (inbox.Cleaner) does
// not remove it while that saga is alive. keys must be distinct.
func (r *Runner) QueueClaimSaga(b *pgx.Batch, keys, sagaIDs []string, claimed *[]bool) error {
	if err := checkKeys(keys); err != nil {
		return fmt.Errorf("%s: %w", r.cfg.What, err)
	}
	if len(sagaIDs) != len(keys) {
		return fmt.Errorf("%s: %d keys but %d saga ids", r.cfg.What, len(keys), len(sagaIDs))
	}
	// In key order, as distinctSorted: two batches lock shared keys in the same order.
	order := make([]int, len(keys))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return strings.Compare(keys[a], keys[b]) })
	ks, ss := make([]string, len(keys)), make([]string, len(keys))
	for j, i := range order {
		ks[j], ss[j] = keys[i], sagaIDs[i]
	}
	b.Queue(r.sql.claimSaga, r.cfg.Consumer, ks, ss).Query(func(rows pgx.Rows) error {
		inserted, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return err
		}
		*claimed = claimedOf(keys, inserted)
		return nil
	})
	return nil
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

// SeenTx reports whether key is recorded for the consumer (see inbox.Inbox.SeenTx).
func (r *Runner) SeenTx(ctx context.Context, tx pgx.Tx, key string) (bool, error) {
	if _, err := CheckKey(key); err != nil {
		return false, fmt.Errorf("%s: %w", r.cfg.What, err)
	}
	var seen bool
	err := tx.QueryRow(ctx, r.sql.seenOne, r.cfg.Consumer, key).Scan(&seen)
	return seen, err
}

// QueueSeen queues the lookup of keys into b; once the batch has run, (*seen)[i] reports
// whether keys[i] is recorded. Like SeenTx it records nothing and does not wait for
// uncommitted claims of other transactions.
func (r *Runner) QueueSeen(b *pgx.Batch, keys []string, seen *[]bool) error {
	if err := checkKeys(keys); err != nil {
		return fmt.Errorf("%s: %w", r.cfg.What, err)
	}
	if len(keys) == 1 {
		b.Queue(r.sql.seenOne, r.cfg.Consumer, keys[0]).QueryRow(func(row pgx.Row) error {
			var found bool
			if err := row.Scan(&found); err != nil {
				return err
			}
			*seen = []bool{found}
			return nil
		})
		return nil
	}
	b.Queue(r.sql.seenMany, r.cfg.Consumer, keys).Query(func(rows pgx.Rows) error {
		found, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return err
		}
		set := make(map[string]bool, len(found))
		for _, k := range found {
			set[k] = true
		}
		*seen = make([]bool, len(keys))
		for i, k := range keys {
			(*seen)[i] = set[k]
		}
		return nil
	})
	return nil
}
