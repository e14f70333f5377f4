package relay

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// Relays lists the relay processes of the schema, by id, from their heartbeat rows
// (relay_member), each with the number of shards it holds a live lease on. A relay that
// stopped keeps its row, no longer live, until a running relay forgets members expired for
// an hour.
func (a *Admin) Relays(ctx context.Context, db DB) ([]Member, error) {
	// One pass over the leases (up to MaxShards rows, no index on owner), not one per member.
	rows, err := db.Query(ctx, `SELECT m.id, m.host, m.pid, m.started_at, m.heartbeat_at, m.expires_at > now(),
			coalesce(l.shards, 0)::int, now() - m.heartbeat_at
		FROM `+a.q.member+` m
		LEFT JOIN (SELECT owner, count(*) AS shards FROM `+a.q.lease+` WHERE expires_at > now() GROUP BY owner) l ON l.owner = m.id
		ORDER BY m.id`)
	if err != nil {
		return nil, a.wrap("read relay members", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Member])
	if err != nil {
		return nil, a.wrap("read relay members", err)
	}
	return out, nil
}

// ShardCount counts the shards of the lease table.
type ShardCount struct {
	// Total is the number of shards (0 before the first relay started on the schema).
	Total int
	// Unowned counts the shards no live relay holds: free, their lease expired, or held by
	// a relay whose heartbeat row expired. Rows of those shards wait until a relay takes
	// them over.
	Unowned int
}

// Shards counts the shards and those without a live owner. It reads the lease table (one
// row per shard) and the members, never the outbox: its cost does not grow with the backlog.
func (a *Admin) Shards(ctx context.Context, db DB) (ShardCount, error) {
	var c ShardCount
	if err := db.QueryRow(ctx, `SELECT count(*)::int, count(*) FILTER (WHERE owner = '' OR expires_at <= now()
		OR NOT EXISTS (SELECT 1 FROM `+a.q.member+` m WHERE m.id = l.owner AND m.expires_at > now()))::int FROM `+a.q.lease+` l`).
		Scan(&c.Total, &c.Unowned); err != nil {
		return ShardCount{}, a.wrap("read shard leases", err)
	}
	return c, nil
}
