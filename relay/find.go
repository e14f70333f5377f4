package relay

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgsql"
)

// ShardLease is the lease of the shard a row belongs to: which relay may publish it.
type ShardLease struct {
	// Shard is the row's shard as the relays compute it: key_hash % the shard count
	// (0 while the lease table has no shards: no relay has started on the schema yet).
	Shard int
	// Owner is the relay instance holding the shard's lease; "" when none does.
	Owner string
	// OwnerLive reports whether Owner's lease has not expired. An expired lease is the
	// relay's that last held it, which stopped renewing it (stopped, hung or cut off).
	OwnerLive bool
}

// FoundRow is an event's row waiting in the outbox, with the lease of its shard.
type FoundRow struct {
	Row
	ShardLease
}

// FoundParkedRow is an event's row in outbox_parked, with the lease of the shard it had.
type FoundParkedRow struct {
	ParkedRow
	ShardLease
}

// Found is where Find found an event.
type Found struct {
	EventID string // the id looked up, in canonical form
	// Pending are the event's rows waiting in the outbox, by id; Parked its rows in
	// outbox_parked, by id. Usually there is at most one row in all: more mean the event
	// was written more than once, or was replayed while a copy was still waiting or parked.
	Pending []FoundRow
	Parked  []FoundParkedRow
	// Scheduled is the event waiting in outbox_scheduled for its due time (outbox.DeliverAt,
	// outbox.DeliverAfter): at most one row, event ids being unique there.
	Scheduled []ScheduledMessage
}

// Where says where the event is: "pending" (in the outbox), "parked" (in outbox_parked),
// "scheduled" (in outbox_scheduled, waiting for its due time), several of them joined by "+"
// ("pending+parked": copies in both), or "gone": in none, so published (a row leaves the
// outbox only after the broker acknowledged it), cancelled while scheduled (outbox.CancelTx),
// or its transaction never committed.
func (f Found) Where() string {
	var in []string
	if len(f.Pending) > 0 {
		in = append(in, "pending")
	}
	if len(f.Parked) > 0 {
		in = append(in, "parked")
	}
	if len(f.Scheduled) > 0 {
		in = append(in, "scheduled")
	}
	if len(in) == 0 {
		return "gone"
	}
	return strings.Join(in, "+")
}

// findSQL reads an event's pending, parked and scheduled rows in one statement, so in one
// snapshot: a row that a relay parks or moves out of outbox_scheduled, or an operator
// replays, while Find reads is seen in exactly one of the tables, never in neither (which
// would report a waiting event as published). $1 is the event id. A row's shard is key_hash %
// the number of shards, as the relays claim it. kind is 0 for pending, 1 for parked, 2 for
// scheduled rows (whose id is their seq).
func findSQL(q *queries, schema string) string {
	cols := `event_id, topic, partition_key, key_hash, octet_length(payload) AS size, metadata, created_at`
	return `WITH n AS (SELECT nullif(count(*), 0)::int AS shards FROM ` + q.lease + `),
	r AS (SELECT 0 AS kind, id, ` + cols + `, attempts, coalesce(last_error, '') AS last_error, NULL::timestamptz AS parked_at,
			''::text AS parked_by, NULL::timestamptz AS due_at
			FROM ` + q.outbox + ` WHERE event_id = $1::uuid
		UNION ALL
		SELECT 1, id, ` + cols + `, attempts, last_error, parked_at, parked_by, NULL
			FROM ` + q.parked + ` WHERE event_id = $1::uuid
		UNION ALL
		SELECT 2, seq, ` + cols + `, 0, '', NULL, '', due_at
			FROM ` + pgsql.Table(schema, "outbox_scheduled") + ` WHERE event_id = $1::uuid)
	SELECT r.kind, r.id, r.event_id::text, r.topic, r.partition_key, r.size, r.metadata, r.created_at, r.attempts, r.last_error,
		r.parked_at, r.parked_by, r.due_at, coalesce(r.key_hash % n.shards, 0)::int, coalesce(l.owner, ''), coalesce(l.expires_at > now(), false)
	FROM r CROSS JOIN n LEFT JOIN ` + q.lease + ` l ON l.shard = r.key_hash % n.shards
	ORDER BY r.kind, r.id`
}

// Find looks an event up by its id (a UUID): its rows waiting in the outbox and its parked
// rows, each with its shard and the relay holding that shard's lease, and its scheduled row
// with its due time (see Found.Where).
//
// It is an operator's lookup, not a hot path: outbox.event_id has no index, because a
// second b-tree on the outbox costs every business commit (DESIGN.md, "Known
// traps"), so Find reads every waiting row once; on a large backlog that takes a while.
// Parked and scheduled rows are found through their event_id indexes.
//
// A row's Metadata is its metadata as written; metadata that is not an object of strings
// is shown as the one entry "(undecodable)" holding the raw JSON, so an operator sees it.
func (a *Admin) Find(ctx context.Context, db DB, eventID string) (Found, error) {
	u, err := uuid.Parse(eventID)
	if err != nil {
		return Found{}, fmt.Errorf("relay: %s is not an event id (a UUID)", strconv.Quote(eventID))
	}
	f := Found{EventID: u.String(), Pending: []FoundRow{}, Parked: []FoundParkedRow{}, Scheduled: []ScheduledMessage{}}
	rows, err := db.Query(ctx, findSQL(a.q, a.schema), f.EventID)
	if err != nil {
		return Found{}, a.wrap("find event "+f.EventID, err)
	}
	var (
		kind     int
		r        ParkedRow
		meta     []byte
		parkedAt *time.Time
		dueAt    *time.Time
		lease    ShardLease
	)
	_, err = pgx.ForEachRow(rows, []any{&kind, &r.ID, &r.EventID, &r.Topic, &r.Key, &r.Size, &meta, &r.CreatedAt, &r.Attempts,
		&r.LastError, &parkedAt, &r.ParkedBy, &dueAt, &lease.Shard, &lease.Owner, &lease.OwnerLive}, func() error {
		r.Metadata = decodeMetadata(meta)
		switch kind {
		case 0:
			f.Pending = append(f.Pending, FoundRow{Row: r.Row, ShardLease: lease})
		case 1:
			if parkedAt != nil { // NOT NULL in outbox_parked
				r.ParkedAt = *parkedAt
			}
			f.Parked = append(f.Parked, FoundParkedRow{ParkedRow: r, ShardLease: lease})
		default:
			m := ScheduledMessage{EventID: r.EventID, Topic: r.Topic, Key: r.Key, Size: r.Size, Metadata: r.Metadata, Seq: r.ID, CreatedAt: r.CreatedAt}
			if dueAt != nil { // NOT NULL in outbox_scheduled
				m.DueAt = *dueAt
			}
			f.Scheduled = append(f.Scheduled, m)
		}
		return nil
	})
	if err != nil {
		return Found{}, a.wrap("find event "+f.EventID, err)
	}
	return f, nil
}

// decodeMetadata decodes a row's metadata for Find.
func decodeMetadata(raw []byte) map[string]string {
	var m map[string]string
	if err := json.Unmarshal(raw, &m); err != nil {
		return map[string]string{"(undecodable)": string(raw)}
	}
	return m
}
