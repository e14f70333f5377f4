package relay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/audit"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/outbox"
)

// DB is what Admin needs from a connection: a *pgxpool.Pool, *pgx.Conn or pgx.Tx.
type DB interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Admin inspects the outbox, lists parked rows and moves them back (what `onceflow outbox`
// does). It holds no connection: every method takes the DB to use.
type Admin struct {
	schema string
	q      *queries
}

// NewAdmin returns an Admin for the tables in schema ("" = "onceflow").
func NewAdmin(schema string) (*Admin, error) {
	if schema == "" {
		schema = pgsql.DefaultSchema
	}
	if err := pgsql.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	return &Admin{schema: schema, q: newQueries(schema)}, nil
}

// Row is an outbox row as the admin tools show it.
type Row struct {
	ID        int64
	EventID   string
	Topic     string
	Key       string
	Size      int // payload bytes
	Metadata  map[string]string
	CreatedAt time.Time
	Attempts  int
	LastError string
}

// ParkedRow is a row in outbox_parked.
type ParkedRow struct {
	Row
	ParkedAt time.Time
	ParkedBy string
}

// Summary is the state of the outbox and of the relays.
type Summary struct {
	// Pending rows waiting: exact when PendingExact, else an estimate (see Backlog.Rows).
	Pending      int64
	PendingExact bool
	// Failing counts the rows the broker refused at least once (attempts > 0) among the
	// oldest SummarySample waiting rows, where refused rows stay.
	Failing int64
	Oldest  time.Time // creation time of the oldest waiting row; zero when none
	Parked  int64     // rows in outbox_parked, counted up to ExactBacklogRows
	// PerTopic counts the oldest SummarySample waiting rows by topic, most first (at most 50).
	PerTopic  []TopicCount
	Shards    int // shard count of the lease table (0 before the first relay started)
	Leases    []OwnerLeases
	Members   []Member
	CheckedAt time.Time // database clock
}

// SummarySample is how many of the oldest waiting rows Summary reads for Failing and
// PerTopic: from the head of the primary key, so a summary costs the same at any backlog.
const SummarySample = 10_000

// TopicCount is the number of waiting rows of one topic.
type TopicCount struct {
	Topic   string
	Pending int64
}

// OwnerLeases is how many shards one relay holds and when the earliest of its leases expires.
type OwnerLeases struct {
	Owner     string // "" for free shards
	Shards    int
	ExpiresAt time.Time
	Live      bool // at least one lease not expired
}

// Member is a relay process, from its heartbeat row (see Admin.Relays).
type Member struct {
	ID          string // the relay's instance id (Config.InstanceID)
	Host        string
	PID         int
	StartedAt   time.Time
	HeartbeatAt time.Time
	// Live reports whether the row has not expired: the process renewed it recently.
	Live bool
	// Shards counts the shards it holds a live lease on.
	Shards int
	// HeartbeatAge is how long ago its last heartbeat was, by the database's clock. A live
	// relay whose heartbeat is old is hung or cannot reach the database.
	HeartbeatAge time.Duration
}

// Summary reads the backlog (Backlog: no count of the whole table), the failing rows and
// topics of the oldest SummarySample rows, the leases and the relay members.
func (a *Admin) Summary(ctx context.Context, db DB) (Summary, error) {
	var s Summary
	b, err := a.Backlog(ctx, db)
	if err != nil {
		return s, err
	}
	s.CheckedAt, s.Pending, s.PendingExact, s.Parked = b.CheckedAt, b.Rows, b.Exact, b.Parked
	if b.OldestID > 0 {
		s.Oldest = b.Oldest
	}
	head := `(SELECT topic, attempts FROM ` + a.q.outbox + ` ORDER BY id LIMIT ` + strconv.Itoa(SummarySample) + `) h`
	if err := db.QueryRow(ctx, `SELECT count(*) FILTER (WHERE attempts > 0) FROM `+head).Scan(&s.Failing); err != nil {
		return s, a.wrap("count failing rows", err)
	}
	rows, err := db.Query(ctx, `SELECT topic, count(*) FROM `+head+` GROUP BY topic ORDER BY count(*) DESC, topic LIMIT 50`)
	if err != nil {
		return s, a.wrap("count rows per topic", err)
	}
	s.PerTopic, err = pgx.CollectRows(rows, pgx.RowToStructByPos[TopicCount])
	if err != nil {
		return s, a.wrap("count rows per topic", err)
	}
	rows, err = db.Query(ctx, `SELECT owner, count(*)::int, min(expires_at), bool_or(expires_at > now()) FROM `+a.q.lease+` GROUP BY owner ORDER BY owner`)
	if err != nil {
		return s, a.wrap("read leases", err)
	}
	s.Leases, err = pgx.CollectRows(rows, pgx.RowToStructByPos[OwnerLeases])
	if err != nil {
		return s, a.wrap("read leases", err)
	}
	for _, l := range s.Leases {
		s.Shards += l.Shards
	}
	if s.Members, err = a.Relays(ctx, db); err != nil {
		return s, err
	}
	return s, nil
}

// PendingFilter selects waiting rows to list.
type PendingFilter struct {
	Topic   string // only this topic
	Key     string // only this partition key
	Failing bool   // only rows the broker refused at least once
	Limit   int    // default 100
}

// Pending lists waiting rows, oldest first.
func (a *Admin) Pending(ctx context.Context, db DB, f PendingFilter) ([]Row, error) {
	w := &where{}
	if f.Topic != "" {
		w.add("topic = " + w.arg(f.Topic))
	}
	if f.Key != "" {
		w.add("partition_key = " + w.arg(f.Key))
	}
	if f.Failing {
		w.add("attempts > 0")
	}
	limit := min(f.Limit, MaxListLimit)
	if limit <= 0 {
		limit = 100
	}
	// Build the text first: w.args must be read after w.arg(limit) appended to it.
	sql := `SELECT id, event_id::text, topic, partition_key, octet_length(payload), metadata, created_at, attempts, coalesce(last_error, '')
		FROM ` + a.q.outbox + w.sql() + ` ORDER BY id LIMIT ` + w.arg(limit)
	rows, err := db.Query(ctx, sql, w.args...)
	if err != nil {
		return nil, a.wrap("list pending rows", err)
	}
	out, err := pgx.CollectRows(rows, scanRow)
	if err != nil {
		return nil, a.wrap("list pending rows", err)
	}
	return out, nil
}

// ParkedFilter selects parked rows. Filters combine with AND.
type ParkedFilter struct {
	IDs      []int64  // the ids the rows had in the outbox (shown by Parked)
	EventIDs []string // event ids (UUIDs)
	Topic    string
	Key      string
	// All selects every parked row. ReplayTx requires it when no other filter is set, so an
	// empty filter never moves everything by accident.
	All bool
	// AfterID continues Parked's listing after the row with this id (the last one of the
	// previous page); ReplayTx and CountParked ignore it.
	AfterID int64
	// Limit caps Parked's listing (default 100, at most MaxListLimit); ReplayTx ignores it.
	Limit int
}

// MaxListLimit caps one page of Pending and Parked, so one call never reads a whole table.
const MaxListLimit = 1000

func (f ParkedFilter) empty() bool {
	return len(f.IDs) == 0 && len(f.EventIDs) == 0 && f.Topic == "" && f.Key == ""
}

func (f ParkedFilter) where() (*where, error) {
	w := &where{}
	if len(f.IDs) > 0 {
		w.add("id = ANY(" + w.arg(f.IDs) + "::bigint[])")
	}
	if len(f.EventIDs) > 0 {
		var bad []string
		for _, id := range f.EventIDs {
			if _, err := uuid.Parse(id); err != nil {
				bad = append(bad, strconv.Quote(id))
			}
		}
		if len(bad) > 0 {
			return nil, fmt.Errorf("relay: not event ids (UUIDs): %s", strings.Join(bad, ", "))
		}
		w.add("event_id = ANY(" + w.arg(f.EventIDs) + "::uuid[])")
	}
	if f.Topic != "" {
		w.add("topic = " + w.arg(f.Topic))
	}
	if f.Key != "" {
		w.add("partition_key = " + w.arg(f.Key))
	}
	return w, nil
}

// Parked lists parked rows, oldest first, with the error that got them parked.
func (a *Admin) Parked(ctx context.Context, db DB, f ParkedFilter) ([]ParkedRow, error) {
	w, err := f.where()
	if err != nil {
		return nil, err
	}
	if f.AfterID > 0 {
		w.add("id > " + w.arg(f.AfterID))
	}
	limit := min(f.Limit, MaxListLimit)
	if limit <= 0 {
		limit = 100
	}
	sql := `SELECT id, event_id::text, topic, partition_key, octet_length(payload), metadata, created_at, attempts, last_error, parked_at, parked_by
		FROM ` + a.q.parked + w.sql() + ` ORDER BY id LIMIT ` + w.arg(limit)
	rows, err := db.Query(ctx, sql, w.args...)
	if err != nil {
		return nil, a.wrap("list parked rows", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (ParkedRow, error) {
		var p ParkedRow
		var meta []byte
		err := row.Scan(&p.ID, &p.EventID, &p.Topic, &p.Key, &p.Size, &meta, &p.CreatedAt, &p.Attempts, &p.LastError, &p.ParkedAt, &p.ParkedBy)
		if err == nil {
			_ = json.Unmarshal(meta, &p.Metadata)
		}
		return p, err
	})
	if err != nil {
		return nil, a.wrap("list parked rows", err)
	}
	return out, nil
}

// CountParked counts the parked rows f selects, up to max (it stops counting there, so a
// dry run costs the same with a million parked rows), and returns the ids of the first
// (oldest) of them, at most ids. An empty filter without All counts nothing: ReplayTx would
// refuse it.
func (a *Admin) CountParked(ctx context.Context, db DB, f ParkedFilter, max, ids int) (int64, []int64, error) {
	if f.empty() && !f.All {
		return 0, nil, ErrEmptyReplayFilter
	}
	w, err := f.where()
	if err != nil {
		return 0, nil, err
	}
	sql := `SELECT count(*), (array_agg(id ORDER BY id))[1:` + w.arg(ids) + `] FROM (SELECT id FROM ` + a.q.parked + w.sql() +
		` ORDER BY id LIMIT ` + w.arg(max) + `) s`
	var n int64
	var first []int64
	if err := db.QueryRow(ctx, sql, w.args...).Scan(&n, &first); err != nil {
		return 0, nil, a.wrap("count parked rows", err)
	}
	return n, first, nil
}

// KeyBacklog is what waits for one topic and partition key.
type KeyBacklog struct {
	Topic    string
	Key      string
	Rows     int64
	Oldest   time.Time // creation time of its oldest waiting row
	Attempts int       // the most failed publish attempts of any of its rows
}

// PendingByKey groups the oldest sample waiting rows by topic and key, oldest first, at most
// limit groups. It reads sample rows from the head of the primary key, not the table: the
// cost is flat at any backlog, and the head is where a stuck key shows.
func (a *Admin) PendingByKey(ctx context.Context, db DB, sample, limit int) ([]KeyBacklog, error) {
	rows, err := db.Query(ctx, `SELECT topic, partition_key, count(*), min(created_at), max(attempts)
		FROM (SELECT topic, partition_key, created_at, attempts FROM `+a.q.outbox+` ORDER BY id LIMIT $1) s
		GROUP BY topic, partition_key ORDER BY min(created_at), topic, partition_key LIMIT $2`, sample, limit)
	if err != nil {
		return nil, a.wrap("group pending rows by key", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[KeyBacklog])
	if err != nil {
		return nil, a.wrap("group pending rows by key", err)
	}
	return out, nil
}

// Replayed is a parked row moved back into the outbox.
type Replayed struct {
	EventID string // unchanged: consumers see the same message id as before
	ID      int64  // its new outbox id
}

// ErrEmptyReplayFilter is returned by ReplayTx for a filter that selects nothing explicitly.
var ErrEmptyReplayFilter = errors.New("relay: replay needs a filter (ids, event ids, topic or key) or All")

// ReplayTx moves the selected parked rows back into the outbox as part of tx, in their
// original order, with their original event id, payload, metadata and key, and a fresh
// attempt count. Their created_at is the replay's time: the age `onceflow status` checks is
// how long a row has waited for the relay since it was last handed to it, so a replayed row
// is not reported stuck for the time it spent parked. They get new outbox ids, so they are published after the rows already
// waiting: a replayed row arrives after later events of its key (parking already broke that
// key's order). The relays are woken when tx commits.
func (a *Admin) ReplayTx(ctx context.Context, tx pgx.Tx, f ParkedFilter) ([]Replayed, error) {
	if f.empty() && !f.All {
		return nil, ErrEmptyReplayFilter
	}
	w, err := f.where()
	if err != nil {
		return nil, err
	}
	rows, err := tx.Query(ctx, `WITH moved AS (DELETE FROM `+a.q.parked+w.sql()+` RETURNING *)
		INSERT INTO `+a.q.outbox+` (event_id, topic, partition_key, key_hash, payload, metadata, created_at)
		SELECT event_id, topic, partition_key, key_hash, payload, metadata, now() FROM moved ORDER BY id
		RETURNING event_id::text, id`, w.args...)
	if err != nil {
		return nil, a.wrap("replay parked rows", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Replayed])
	if err != nil {
		return nil, a.wrap("replay parked rows", err)
	}
	if len(out) > 0 {
		if _, err := tx.Exec(ctx, `SELECT pg_notify($1, '')`, outbox.NotifyChannel(a.schema)); err != nil {
			return nil, a.wrap("notify relays", err)
		}
		ids := make([]string, len(out))
		for i, r := range out {
			ids[i] = r.EventID
		}
		if err := audit.RecordTx(audit.WithFilter(ctx, f.describe()), tx, a.schema, audit.OutboxReplay, ids, fmt.Sprintf("rows moved back to the outbox: %d", len(out))); err != nil {
			return nil, a.wrap("record the replay", err)
		}
	}
	return out, nil
}

// describe says what f selects, for the audit record.
func (f ParkedFilter) describe() string {
	var parts []string
	if len(f.IDs) > 0 {
		parts = append(parts, fmt.Sprintf("ids %v", f.IDs))
	}
	if len(f.EventIDs) > 0 {
		parts = append(parts, "event ids "+strings.Join(f.EventIDs, ","))
	}
	if f.Topic != "" {
		parts = append(parts, fmt.Sprintf("topic %q", f.Topic))
	}
	if f.Key != "" {
		parts = append(parts, fmt.Sprintf("key %q", f.Key))
	}
	if len(parts) == 0 {
		return "all"
	}
	return strings.Join(parts, ", ")
}

func (a *Admin) wrap(what string, err error) error {
	if pgsql.IsUndefinedTable(err) {
		return fmt.Errorf("relay: %s: schema %q is not migrated; run `onceflow migrate up --schema %s`: %w", what, a.schema, a.schema, err)
	}
	return fmt.Errorf("relay: %s in schema %q: %w", what, a.schema, err)
}

func scanRow(row pgx.CollectableRow) (Row, error) {
	var r Row
	var meta []byte
	err := row.Scan(&r.ID, &r.EventID, &r.Topic, &r.Key, &r.Size, &meta, &r.CreatedAt, &r.Attempts, &r.LastError)
	if err == nil {
		_ = json.Unmarshal(meta, &r.Metadata) // shown best effort; the relay refuses bad metadata itself
	}
	return r, err
}

// where builds a WHERE clause with numbered parameters.
type where struct {
	conds []string
	args  []any
}

func (w *where) arg(v any) string { w.args = append(w.args, v); return "$" + strconv.Itoa(len(w.args)) }
func (w *where) add(cond string)  { w.conds = append(w.conds, cond) }
func (w *where) sql() string {
	if len(w.conds) == 0 {
		return ""
	}
	return " WHERE " + strings.Join(w.conds, " AND ")
}
