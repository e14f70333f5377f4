package relay

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgsql"
)

// ErrShardCountMismatch is returned by Run when the lease table was set up with a different
// number of shards than Config.Shards, at start or because it was resharded while this relay
// was cut off from the database or paused (its leases had expired, so Reshard went ahead).
var ErrShardCountMismatch = errors.New("relay: shard count differs from the lease table")

// shardMismatch is the error for a lease table holding n shards while cfg has another count.
func shardMismatch(cfg Config, n int) error {
	return fmt.Errorf("%w: the lease table in schema %q has %d shards, this relay is configured with %d. Every relay of a schema must use the same count: start it with --shards %d (Config.Shards), or stop every relay and change the count with `onceflow relay --reshard --shards %d` (relay.Reshard)",
		ErrShardCountMismatch, cfg.Schema, n, cfg.Shards, n, cfg.Shards)
}

func shardCount(ctx context.Context, tx pgx.Tx, q *queries) (n, maxShard int, err error) {
	if err := tx.QueryRow(ctx, `SELECT count(*), coalesce(max(shard), -1) FROM `+q.lease).Scan(&n, &maxShard); err != nil {
		return 0, 0, fmt.Errorf("relay: read shard leases: %w", err)
	}
	return n, maxShard, nil
}

// ReshardOptions configures Reshard.
type ReshardOptions struct {
	// Schema holds the relay tables. Default "onceflow".
	Schema string
	// Shards is the new shard count, 1 to MaxShards.
	Shards int
}

// Reshard changes the number of virtual shards. It refuses while any relay holds a live lease
// or heartbeat, because a running relay publishing with the old count could break per-key
// order; stop every relay (or wait for their leases to expire) first. Pending rows are simply
// reassigned: shard = key_hash % Shards.
func Reshard(ctx context.Context, pool *pgxpool.Pool, opts ReshardOptions) error {
	if opts.Schema == "" {
		opts.Schema = pgsql.DefaultSchema
	}
	var problems []error
	if err := pgsql.ValidateSchema(opts.Schema); err != nil {
		problems = append(problems, err)
	}
	if opts.Shards < 1 || opts.Shards > MaxShards {
		problems = append(problems, fmt.Errorf("shard count %d: use 1 to %d", opts.Shards, MaxShards))
	}
	if err := errors.Join(problems...); err != nil {
		return fmt.Errorf("relay: reshard: %w", err)
	}
	q := newQueries(opts.Schema)
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('onceflow.relay'), hashtext($1))`, opts.Schema); err != nil {
			return fmt.Errorf("relay: reshard: lock lease table: %w", err)
		}
		rows, err := tx.Query(ctx, `SELECT DISTINCT owner FROM `+q.lease+` WHERE owner <> '' AND expires_at > now()
			UNION SELECT id FROM `+q.member+` WHERE expires_at > now()`)
		if err != nil {
			return fmt.Errorf("relay: reshard: read leases: %w", err)
		}
		live, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return fmt.Errorf("relay: reshard: read leases: %w", err)
		}
		if len(live) > 0 {
			return fmt.Errorf("relay: reshard: relays %v are running (live lease or heartbeat); stop every relay of schema %q, or wait until their leases expire, then retry", live, opts.Schema)
		}
		if _, err := tx.Exec(ctx, `DELETE FROM `+q.lease); err != nil {
			return fmt.Errorf("relay: reshard: %w", err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+q.lease+` (shard) SELECT generate_series(0, $1::int - 1)`, opts.Shards); err != nil {
			return fmt.Errorf("relay: reshard: %w", err)
		}
		return nil
	})
}
