package inbox

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/audit"
	"github.com/onceflow/onceflow/internal/pgsql"
)

// The retry lane's operator side (inbox_parked, migration 0022; see RetryAfter): what waits,
// behind which key, since when and until when, and "retry now" for a head whose provider is
// back.
//
// Every read is bounded by one of the table's indexes, which the consumers need anyway: a page
// in lane order is a range of inbox_parked_lane_idx (consumer, topic, lane, id), so it costs
// the same deep in a long lane as at its head; the heads (one per key, the only rows with a
// due time) are inbox_parked_due_idx (consumer, due_at); counts stop at ParkedCountCap. No
// read passes over the whole table: during a long outage it holds every message of every
// key that waits.

// ParkedRow is a message waiting in the retry lane: one row of inbox_parked.
type ParkedRow struct {
	ID       int64
	Consumer string // inbox.Config.Consumer of the consumer that parked it
	Topic    string // the topic it was consumed from
	// Lane is its key in the lane (its partition key, or Config.LaneKey's); "" when it has
	// none: it was parked alone and nothing waits behind it.
	Lane        string
	DedupKey    string
	MessageUUID string
	// Source is where it was consumed: topic/partition@offset for a batched consumer, the
	// topic for a router's handler.
	Source string
	// Handler is the router handler that parked it; "" for a batched consumer.
	Handler string
	// Attempts counts its failed attempts so far; Error is the last one's ("" for a row parked
	// behind its key's head: it has not run).
	Attempts int
	Error    string
	// DueAt is when a process of its consumer applies it; nil while it waits behind an
	// earlier row of its lane (it becomes due, at once, when that row leaves the lane).
	DueAt    *time.Time
	ParkedAt time.Time
	// Head is true for the first row of its lane: the one applied when due. The others wait
	// behind it, in order.
	Head bool
}

// ParkedOrder is the order Parked lists rows in.
type ParkedOrder string

const (
	// ParkedByLane lists the rows of each lane together — its head, then the rows behind
	// it in order — by consumer, topic, key; then the rows parked without a key, by id. A
	// page is a range of inbox_parked_lane_idx.
	ParkedByLane ParkedOrder = "lane"
	// ParkedByID lists rows by id: in the order they were parked. Without a filter a page is a
	// range of the primary key; with one, a page tests at most MaxParkedScan rows in id order
	// (no index orders a consumer's rows by id; see ParkedPage.Searched).
	ParkedByID ParkedOrder = "id"
)

// MaxParkedScan bounds the rows one page of Parked in ParkedByID order reads when filtered.
const MaxParkedScan = 20_000

// ParkedFilter selects a page of parked rows for Parked.
type ParkedFilter struct {
	// Consumer selects one consumer's rows; "" every consumer's.
	Consumer string
	// Topic selects the rows of one topic; Lane, with Topic, the rows of one key. A lane is
	// one consumer's and one topic's: Topic needs Consumer, and Lane both, so a page stays a
	// range of the lane index.
	Topic, Lane string
	// Order is ParkedByLane ("", the default) or ParkedByID.
	Order ParkedOrder
	// After continues a listing: the ParkedPage.Next of the previous page (of the same order).
	After string
	// Limit is the page's size: 0 means DefaultListLimit, at most MaxListLimit.
	Limit int
}

// ParkedPage is one page of parked rows.
type ParkedPage struct {
	Rows []ParkedRow
	// Next is the ParkedFilter.After of the following page; "" when this page is the last.
	Next string
	// Searched is set (to MaxParkedScan) when a filtered ParkedByID page read that many rows
	// without filling up: more may match further on, and Next goes on from the last row read.
	Searched int
	// CheckedAt is the database's clock when the page was read: a row's DueAt minus it is how
	// long until it is due.
	CheckedAt time.Time
}

// ErrBadParkedCursor is returned by Parked for a ParkedFilter.After that no page of its order
// returned.
var ErrBadParkedCursor = errors.New("inbox: not a cursor of a page of parked rows in this order (pass the Next of the previous page)")

// parkedCursor is the position after a row in a listing: in lane order (consumer, topic, lane,
// id), or in the part of it without a lane (Alone, by id); in id order, the id.
type parkedCursor struct {
	Order    ParkedOrder `json:"o"`
	Consumer string      `json:"c,omitempty"`
	Topic    string      `json:"t,omitempty"`
	Lane     string      `json:"l,omitempty"`
	Alone    bool        `json:"a,omitempty"`
	ID       int64       `json:"i"`
}

func (c parkedCursor) String() string {
	b, _ := json.Marshal(c)
	return base64.RawURLEncoding.EncodeToString(b)
}

func parseParkedCursor(s string, order ParkedOrder) (parkedCursor, error) {
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return parkedCursor{}, fmt.Errorf("%w: %q", ErrBadParkedCursor, s)
	}
	var c parkedCursor
	if err := json.Unmarshal(b, &c); err != nil || c.Order != order || c.ID < 0 {
		return parkedCursor{}, fmt.Errorf("%w: %q", ErrBadParkedCursor, s)
	}
	return c, nil
}

func (f *ParkedFilter) check() error {
	var problems []string
	switch f.Order {
	case "":
		f.Order = ParkedByLane
	case ParkedByLane, ParkedByID:
	default:
		problems = append(problems, fmt.Sprintf("Order is %q; use %q (the default) or %q", f.Order, ParkedByLane, ParkedByID))
	}
	switch {
	case (f.Topic != "" || f.Lane != "") && f.Consumer == "":
		problems = append(problems, "a topic or a key selects lanes, and lanes are a consumer's: give the Consumer too")
	case f.Lane != "" && f.Topic == "":
		problems = append(problems, "a key's lane is one topic's: give the Topic too")
	}
	if f.Limit < 0 || f.Limit > MaxListLimit {
		problems = append(problems, fmt.Sprintf("Limit is %d; use 0 for the default (%d) or 1..%d", f.Limit, DefaultListLimit, MaxListLimit))
	}
	if len(problems) > 0 {
		return fmt.Errorf("inbox: list parked rows: %s", strings.Join(problems, "; "))
	}
	return nil
}

// parkedCols are the columns a ParkedRow is read from (readParked), with the database's
// clock; the head test probes the lane index for an earlier row of the lane.
func (a *Admin) parkedCols() string {
	return `p.id, p.consumer, p.topic, coalesce(p.lane, ''), p.dedup_key, p.message_uuid, p.source, p.handler, p.attempts, p.error, p.due_at, p.parked_at,
		(p.lane IS NULL OR NOT EXISTS (SELECT 1 FROM ` + a.parkedTable() + ` x
			WHERE x.consumer = p.consumer AND x.topic = p.topic AND x.lane = p.lane AND x.id < p.id)), now()`
}

func (a *Admin) parkedTable() string { return pgsql.Table(a.schema, "inbox_parked") }

// Parked lists the parked rows f selects, a page at a time: in lane order (ParkedByLane, the
// default: each key's head, then the rows behind it) or in the order they were parked
// (ParkedByID). The next page is f with After set to the page's Next. Every page is read from
// an index (see ParkedOrder), so it costs the same at any depth.
func (a *Admin) Parked(ctx context.Context, db DB, f ParkedFilter) (ParkedPage, error) {
	if err := f.check(); err != nil {
		return ParkedPage{}, err
	}
	limit := f.Limit
	if limit == 0 {
		limit = DefaultListLimit
	}
	var cur *parkedCursor
	if f.After != "" {
		c, err := parseParkedCursor(f.After, f.Order)
		if err != nil {
			return ParkedPage{}, err
		}
		cur = &c
	}
	if f.Order == ParkedByID {
		return a.parkedByID(ctx, db, f, cur, limit)
	}
	var p ParkedPage
	// The lanes first, then (unless a key was asked for) the rows parked without one. One
	// row more than the page tells whether another page follows.
	if cur == nil || !cur.Alone {
		w := &where{}
		w.add("p.lane IS NOT NULL")
		a.parkedFilter(w, f)
		if cur != nil {
			w.add("(p.consumer, p.topic, p.lane, p.id) > (" + w.arg(cur.Consumer) + "::text, " + w.arg(cur.Topic) + "::text, " +
				w.arg(cur.Lane) + "::text, " + w.arg(cur.ID) + "::bigint)")
		}
		sql := `SELECT ` + a.parkedCols() + ` FROM ` + a.parkedTable() + ` p` + w.sql() +
			` ORDER BY p.consumer, p.topic, p.lane, p.id LIMIT ` + w.arg(limit+1)
		if err := a.readParked(ctx, db, &p, sql, w.args); err != nil {
			return ParkedPage{}, err
		}
	}
	if len(p.Rows) <= limit && f.Lane == "" {
		// A row without a key is always a head (nothing parks behind it), so it has a due
		// time: the condition lets the walk be the consumer's heads (inbox_parked_due_idx),
		// not every row of the table.
		w := &where{}
		w.add("p.lane IS NULL AND p.due_at IS NOT NULL")
		a.parkedFilter(w, f)
		if cur != nil && cur.Alone {
			w.add("p.id > " + w.arg(cur.ID))
		}
		sql := `SELECT ` + a.parkedCols() + ` FROM ` + a.parkedTable() + ` p` + w.sql() + ` ORDER BY p.id LIMIT ` + w.arg(limit+1-len(p.Rows))
		if err := a.readParked(ctx, db, &p, sql, w.args); err != nil {
			return ParkedPage{}, err
		}
	}
	if len(p.Rows) > limit {
		p.Rows = p.Rows[:limit]
		last := p.Rows[limit-1]
		c := parkedCursor{Order: ParkedByLane, ID: last.ID, Alone: last.Lane == ""}
		if !c.Alone {
			c.Consumer, c.Topic, c.Lane = last.Consumer, last.Topic, last.Lane
		}
		p.Next = c.String()
	}
	return p, nil
}

// parkedByID reads a page in id order: the primary key's range, and with a filter the matches
// among the next MaxParkedScan rows of it.
func (a *Admin) parkedByID(ctx context.Context, db DB, f ParkedFilter, cur *parkedCursor, limit int) (ParkedPage, error) {
	// from is the walk of the primary key from the cursor: every row, or with a filter the
	// next MaxParkedScan (the filter is tested on what it returns).
	from, args := a.parkedTable()+` p`, []any{}
	after := ""
	if cur != nil {
		after, args = ` WHERE id > $1`, []any{cur.ID}
	}
	filtered := f.Consumer != ""
	if filtered {
		from = `(SELECT * FROM ` + a.parkedTable() + after + ` ORDER BY id LIMIT ` + strconv.Itoa(MaxParkedScan) + `) p`
	} else {
		from += after
	}
	w := &where{args: slices.Clone(args)}
	a.parkedFilter(w, f)
	sql := `SELECT ` + a.parkedCols() + ` FROM ` + from + w.sql() + ` ORDER BY p.id LIMIT ` + w.arg(limit+1)
	var p ParkedPage
	if err := a.readParked(ctx, db, &p, sql, w.args); err != nil {
		return ParkedPage{}, err
	}
	if len(p.Rows) > limit {
		p.Rows = p.Rows[:limit]
		p.Next = parkedCursor{Order: ParkedByID, ID: p.Rows[limit-1].ID}.String()
		return p, nil
	}
	if filtered {
		// The page did not fill: was the walk cut at MaxParkedScan? The last row it read is
		// where the next page goes on.
		var last int64
		err := db.QueryRow(ctx, `SELECT id FROM `+a.parkedTable()+after+` ORDER BY id OFFSET `+strconv.Itoa(MaxParkedScan-1)+` LIMIT 1`, args...).Scan(&last)
		switch {
		case errors.Is(err, pgx.ErrNoRows): // the walk read every row there is
		case err != nil:
			return ParkedPage{}, a.wrap("list parked rows", err)
		default:
			p.Next, p.Searched = parkedCursor{Order: ParkedByID, ID: last}.String(), MaxParkedScan
		}
	}
	return p, nil
}

// parkedFilter adds f's consumer, topic and key to w.
func (a *Admin) parkedFilter(w *where, f ParkedFilter) {
	if f.Consumer != "" {
		w.add("p.consumer = " + w.arg(f.Consumer))
	}
	if f.Topic != "" {
		w.add("p.topic = " + w.arg(f.Topic))
	}
	if f.Lane != "" {
		w.add("p.lane = " + w.arg(f.Lane))
	}
}

// readParked appends the rows of sql to p.
func (a *Admin) readParked(ctx context.Context, db DB, p *ParkedPage, sql string, args []any) error {
	rows, err := db.Query(ctx, sql, args...)
	if err != nil {
		return a.wrap("list parked rows", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (ParkedRow, error) {
		var r ParkedRow
		err := row.Scan(&r.ID, &r.Consumer, &r.Topic, &r.Lane, &r.DedupKey, &r.MessageUUID, &r.Source, &r.Handler, &r.Attempts, &r.Error,
			&r.DueAt, &r.ParkedAt, &r.Head, &p.CheckedAt)
		return r, err
	})
	if err != nil {
		return a.wrap("list parked rows", err)
	}
	p.Rows = append(p.Rows, out...)
	return nil
}

// ParkedCountCap bounds ParkedSummary's counts per consumer: it stops counting there, so a
// status read costs the same with a million parked messages (ConsumerParked.RowsExact and
// KeysExact say when it stopped).
const ParkedCountCap = 10_000

// ConsumerParked is what waits in one consumer's retry lane.
type ConsumerParked struct {
	Consumer string
	// Rows counts its parked messages, the keys' heads and the messages behind them: exact
	// when RowsExact, else more than ParkedCountCap (and Rows is ParkedCountCap+1).
	Rows      int64
	RowsExact bool
	// Keys counts the keys (lanes) that hold parked messages — their heads, the only rows
	// with a due time; a message parked without a key is a head of its own: exact when
	// KeysExact, else more than ParkedCountCap.
	Keys      int64
	KeysExact bool
	// Oldest is when the oldest head was parked: its key has waited longest, none of its
	// later messages applied since. OldestTopic and OldestLane name its lane ("" when it has
	// no key), OldestID its row. With more than ParkedCountCap keys, it is the oldest among
	// the ParkedCountCap heads due soonest.
	Oldest      time.Time
	OldestTopic string
	OldestLane  string
	OldestID    int64
	// NextDue is the earliest due time of its heads: when a process of the consumer next
	// applies one. In the past only while due heads wait to be applied (see Lag).
	NextDue time.Time
	// CheckedAt is the database's clock when the figures were read.
	CheckedAt time.Time
}

// OldestAge is how long the oldest head has waited, on the database's clock.
func (c ConsumerParked) OldestAge() time.Duration {
	if c.Oldest.IsZero() {
		return 0
	}
	return max(c.CheckedAt.Sub(c.Oldest), 0)
}

// Lag is how long the earliest due head is past its due time: 0 when none is due. A process
// of the consumer applies due heads within Config.LaneInterval (1 s by default) plus the
// handler's time; a lag that keeps growing means none runs (or a router without
// Inbox.RouterPlugin).
func (c ConsumerParked) Lag() time.Duration {
	if c.NextDue.IsZero() {
		return 0
	}
	return max(c.CheckedAt.Sub(c.NextDue), 0)
}

// ParkedSummary counts, per consumer (in name order), what waits in the retry lane: rows and
// keys (up to ParkedCountCap), the oldest head and its key, the next due. One statement, every
// part of it an index range: the consumers (a walk that skips from one to the next) and their
// heads from inbox_parked_due_idx (heads only: one per key), the rows from
// inbox_parked_key_idx, stopping at the cap. Measured on 2 busy shared cores
// (TestParkedReadCost): at 100,000 parked rows over 1,000 keys, 12–16 ms right after they were
// parked (the visibility map not yet set: index-only reads still visit the table) and 2–6 ms
// once vacuumed; at 100,000 rows without a key (each a head), 37–59 ms and 6–12 ms. One
// exact pass over the table instead (count, count of distinct lanes, min) took 90–330 ms.
func (a *Admin) ParkedSummary(ctx context.Context, db DB) ([]ConsumerParked, error) {
	t := a.parkedTable()
	capped := strconv.Itoa(ParkedCountCap + 1)
	// The oldest head is looked for among the cap's heads due soonest. The consumers are
	// collected into an array first: the planner guesses 10 rows for its unnest, where it
	// guesses 100 for the recursive walk itself, and at 100 its estimate crosses jit_above_cost
	// and compiling the statement takes longer (10–20 ms) than running it.
	rows, err := db.Query(ctx, `SELECT h.consumer,
			(SELECT count(*) FROM (SELECT 1 FROM `+t+` x WHERE x.consumer = h.consumer LIMIT `+capped+`) s),
			(SELECT count(*) FROM (SELECT 1 FROM `+t+` x WHERE x.consumer = h.consumer AND x.due_at IS NOT NULL LIMIT `+capped+`) s),
			(SELECT min(x.due_at) FROM `+t+` x WHERE x.consumer = h.consumer AND x.due_at IS NOT NULL),
			o.id, o.topic, coalesce(o.lane, ''), o.parked_at, now()
		FROM unnest(ARRAY(WITH RECURSIVE c AS (
				(SELECT consumer FROM `+t+` WHERE due_at IS NOT NULL ORDER BY consumer LIMIT 1)
				UNION ALL
				SELECT (SELECT x.consumer FROM `+t+` x WHERE x.due_at IS NOT NULL AND x.consumer > c.consumer ORDER BY x.consumer LIMIT 1)
				FROM c WHERE c.consumer IS NOT NULL)
			SELECT consumer FROM c WHERE consumer IS NOT NULL)) AS h(consumer)
		LEFT JOIN LATERAL (SELECT id, topic, lane, parked_at FROM (SELECT id, topic, lane, parked_at FROM `+t+` x
			WHERE x.consumer = h.consumer AND x.due_at IS NOT NULL ORDER BY x.due_at LIMIT `+capped+`) d ORDER BY parked_at, id LIMIT 1) o ON true
		ORDER BY h.consumer`)
	if err != nil {
		return nil, a.wrap("count parked rows per consumer", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (ConsumerParked, error) {
		var c ConsumerParked
		var next, oldest *time.Time
		var topic *string
		var id *int64
		err := row.Scan(&c.Consumer, &c.Rows, &c.Keys, &next, &id, &topic, &c.OldestLane, &oldest, &c.CheckedAt)
		c.RowsExact, c.KeysExact = c.Rows <= ParkedCountCap, c.Keys <= ParkedCountCap
		if next != nil {
			c.NextDue = *next
		}
		if id != nil && topic != nil && oldest != nil {
			c.OldestID, c.OldestTopic, c.Oldest = *id, *topic, *oldest
		}
		return c, err
	})
	if err != nil {
		return nil, a.wrap("count parked rows per consumer", err)
	}
	return out, nil
}

// ErrNoParkedRow is wrapped by ReleaseTx's error for ids that name no parked row.
var ErrNoParkedRow = errors.New("no parked row matches")

// ErrReleaseRefused is wrapped by ReleaseTx's error for a row that waits behind its key's head:
// only a head can be applied, so only a head can be released.
var ErrReleaseRefused = errors.New("release refused")

// MaxReleaseLimit bounds one release by consumer; a larger one is several, each recorded.
const MaxReleaseLimit = 10_000

// ReleaseFilter selects the heads ReleaseTx makes due now: the rows IDs names (of Consumer,
// when set), or else every head of Consumer not yet due, the soonest due first, at most Limit.
type ReleaseFilter struct {
	IDs      []int64
	Consumer string
	// Limit bounds a release by consumer: default and maximum MaxReleaseLimit.
	Limit int
}

// ErrEmptyReleaseFilter is returned for a ReleaseFilter with neither ids nor a consumer.
var ErrEmptyReleaseFilter = errors.New("inbox: release parked rows: name the rows (ids) or their consumer; a release never takes every consumer's rows")

// ReleaseTx makes the heads f selects due now — "retry now", once the provider they wait for
// is back — records the release in the audit trail (package audit, audit.InboxRelease, by the
// actor ctx carries) in the same transaction, and returns the ids released, in id order. A
// running process of the consumer applies each within its Config.LaneInterval (1 s by
// default), like any due head: exactly once, its key's later messages after it. Nothing else
// changes: attempts stay counted, and a head that asks for later again is parked again.
//
// By ids every row must be a head (a row behind waits for its head, which is the one to
// release) of Consumer when set, or nothing is released: the error wraps ErrNoParkedRow or
// ErrReleaseRefused and says which. A head that is due already stays as it is (its lag still
// shows), and is not returned.
func (a *Admin) ReleaseTx(ctx context.Context, tx pgx.Tx, f ReleaseFilter) ([]int64, error) {
	if len(f.IDs) == 0 && f.Consumer == "" {
		return nil, ErrEmptyReleaseFilter
	}
	switch {
	case f.Limit == 0:
		f.Limit = MaxReleaseLimit
	case f.Limit < 0 || f.Limit > MaxReleaseLimit:
		return nil, fmt.Errorf("inbox: release parked rows: limit %d is not between 1 and %d", f.Limit, MaxReleaseLimit)
	}
	t := a.parkedTable()
	var ids []int64
	if len(f.IDs) > 0 {
		var err error
		if ids, err = a.releasable(ctx, tx, f); err != nil {
			return nil, err
		}
	} else {
		// The consumer's heads not yet due, on inbox_parked_due_idx. FOR NO KEY UPDATE, the
		// update's own lock, does not wait for the consumers' lane checks (FOR KEY SHARE).
		rows, err := tx.Query(ctx, `SELECT id FROM `+t+` WHERE consumer = $1 AND due_at > now() ORDER BY due_at, id LIMIT $2 FOR NO KEY UPDATE`,
			f.Consumer, f.Limit)
		if err != nil {
			return nil, a.wrap("release parked rows", err)
		}
		if ids, err = pgx.CollectRows(rows, pgx.RowTo[int64]); err != nil {
			return nil, a.wrap("release parked rows", err)
		}
	}
	if len(ids) == 0 {
		return nil, nil
	}
	rows, err := tx.Query(ctx, `UPDATE `+t+` SET due_at = now() WHERE id = ANY($1) AND due_at > now() RETURNING id`, ids)
	if err != nil {
		return nil, a.wrap("release parked rows", err)
	}
	released, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, a.wrap("release parked rows", err)
	}
	if len(released) == 0 {
		return nil, nil
	}
	slices.Sort(released) // RETURNING follows no order
	targets := make([]string, len(released))
	for i, id := range released {
		targets[i] = strconv.FormatInt(id, 10)
	}
	filter := ""
	if len(f.IDs) == 0 {
		filter = "consumer=" + f.Consumer
	}
	if err := audit.RecordTx(audit.WithFilter(ctx, filter), tx, a.schema, audit.InboxRelease, targets,
		fmt.Sprintf("retry-lane heads made due now: %d", len(released))); err != nil {
		return nil, a.wrap("record the release", err)
	}
	return released, nil
}

// releasable reads and locks the rows f.IDs names and returns those not yet due, or an error
// naming every row that is missing, of another consumer or behind its key's head.
func (a *Admin) releasable(ctx context.Context, tx pgx.Tx, f ReleaseFilter) ([]int64, error) {
	t := a.parkedTable()
	rows, err := tx.Query(ctx, `SELECT p.id, p.consumer, p.topic, coalesce(p.lane, ''), p.due_at IS NOT NULL AND p.due_at > now(),
			(SELECT min(x.id) FROM `+t+` x WHERE x.consumer = p.consumer AND x.topic = p.topic AND x.lane = p.lane AND x.id < p.id)
		FROM `+t+` p WHERE p.id = ANY($1) ORDER BY p.id FOR NO KEY UPDATE OF p`, f.IDs)
	if err != nil {
		return nil, a.wrap("release parked rows", err)
	}
	type cand struct {
		id                    int64
		consumer, topic, lane string
		later                 bool
		head                  *int64
	}
	var found []cand
	for rows.Next() {
		var c cand
		if err := rows.Scan(&c.id, &c.consumer, &c.topic, &c.lane, &c.later, &c.head); err != nil {
			rows.Close()
			return nil, a.wrap("release parked rows", err)
		}
		found = append(found, c)
	}
	if err := rows.Err(); err != nil {
		return nil, a.wrap("release parked rows", err)
	}
	var missing, refused []string
	var ids []int64
	for _, id := range f.IDs {
		i := slices.IndexFunc(found, func(c cand) bool { return c.id == id })
		switch {
		case i < 0:
			missing = append(missing, strconv.FormatInt(id, 10))
		case f.Consumer != "" && found[i].consumer != f.Consumer:
			missing = append(missing, strconv.FormatInt(id, 10))
		case found[i].head != nil:
			c := found[i]
			refused = append(refused, fmt.Sprintf("row %d waits behind row %d, the head of key %q (topic %s, consumer %q): release row %d",
				c.id, *c.head, c.lane, c.topic, c.consumer, *c.head))
		case found[i].later && !slices.Contains(ids, id):
			ids = append(ids, id)
		}
	}
	if len(missing) > 0 {
		of := ""
		if f.Consumer != "" {
			of = fmt.Sprintf(" of consumer %q", f.Consumer)
		}
		return nil, fmt.Errorf("inbox: release: %w: no parked row%s with id %s in schema %q (applied or given up already? `onceflow inbox parked` lists them); nothing released",
			ErrNoParkedRow, of, strings.Join(missing, ", "), a.schema)
	}
	if len(refused) > 0 {
		return nil, fmt.Errorf("inbox: release: %w: %s; nothing released", ErrReleaseRefused, strings.Join(refused, "; "))
	}
	return ids, nil
}
