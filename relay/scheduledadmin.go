package relay

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgsql"
)

// The read side of scheduled messages (outbox.DeliverAt, outbox.DeliverAfter) for operators:
// what waits in outbox_scheduled, when it is due, and whether relays move it in time.
//
// Every read here is bounded by the index on (due_at, seq) (migration 0021) — the only index
// of the table besides its primary key, and the one the relays need anyway — so a million
// rows scheduled for tomorrow cost `onceflow status`, the console and the relays' metrics what
// a hundred do. Counts stop at ExactBacklogRows, as Backlog's do; a topic filter is tested on
// a bounded walk of the due index (no index on topic: the table would pay for it on every
// write and every move); the one full count, by topic, is a separate call that says so.

// ScheduledOverdueAfter is how long past its due time a scheduled message must still wait in
// outbox_scheduled to count as overdue. A running relay moves a due message into the outbox
// within Config.ScheduledCheckInterval (500 ms) of its due time, or at once when it sleeps
// until it, and publishes it within about a second; 5 s leaves room for a relay's restart or
// a slow move without reporting a healthy system. A message overdue for longer than that
// means no relay of the schema moves scheduled messages: none runs, all run a version older
// than scheduled messages, or they cannot reach the database.
const ScheduledOverdueAfter = 5 * time.Second

// ScheduledMessage is a message waiting in outbox_scheduled for its due time.
type ScheduledMessage struct {
	EventID  string // its id for life; outbox.CancelTx withdraws it by this id
	Topic    string
	Key      string            // partition key ("" when none)
	Size     int               // payload bytes
	Metadata map[string]string // as written; see Find for undecodable metadata
	// DueAt is when it is due, on the database's clock: a relay moves it into the outbox then.
	DueAt time.Time
	// Seq orders messages due at the same time: their write order.
	Seq int64
	// CreatedAt is when it was written (scheduled).
	CreatedAt time.Time
}

// ScheduledFilter selects scheduled messages to list.
type ScheduledFilter struct {
	// Topic lists only messages of this topic. No index serves it: a page tests at most
	// MaxScheduledScan rows in due order, so a topic with few messages among many never reads
	// the whole table (see ScheduledPage.Searched).
	Topic string
	// After continues a listing after the last message of a page: the ScheduledPage.Next it
	// returned.
	After string
	// Limit is the page size: default 100, at most MaxListLimit.
	Limit int
}

// ScheduledPage is one page of scheduled messages, in due order.
type ScheduledPage struct {
	Messages []ScheduledMessage
	// Next is the ScheduledFilter.After of the following page; "" when this page is the last.
	Next string
	// Searched is set (to MaxScheduledScan) when a topic filter read that many rows without
	// filling the page: more may match further on, and Next goes on from the last row read.
	Searched int
}

// MaxScheduledScan bounds the rows one page of Scheduled reads for a topic filter.
const MaxScheduledScan = 20_000

// ErrBadScheduledCursor is returned by Scheduled for a ScheduledFilter.After that no page
// returned.
var ErrBadScheduledCursor = errors.New("relay: not a cursor of a page of scheduled messages (pass the Next of the previous page)")

// Scheduled lists scheduled messages in due order (due time, then write order), a page at a
// time. Pages are keyset-paginated on the due index: a page deep in a million rows costs what
// the first one does.
func (a *Admin) Scheduled(ctx context.Context, db DB, f ScheduledFilter) (ScheduledPage, error) {
	limit := f.Limit
	switch {
	case limit == 0:
		limit = 100
	case limit < 0 || limit > MaxListLimit:
		return ScheduledPage{}, fmt.Errorf("relay: a page of scheduled messages holds 1 to %d, not %d", MaxListLimit, limit)
	}
	w := &where{}
	if f.After != "" {
		c, err := parseScheduledCursor(f.After)
		if err != nil {
			return ScheduledPage{}, fmt.Errorf("%w: %q", ErrBadScheduledCursor, f.After)
		}
		w.add("(due_at, seq) > (" + w.arg(c.due) + "::timestamptz, " + w.arg(c.seq) + "::bigint)")
	}
	indexed := len(w.args)
	sched := a.scheduledTable()
	const cols = `event_id::text, topic, partition_key, octet_length(payload), metadata, due_at, seq, created_at`
	var sql string
	if f.Topic == "" {
		sql = `SELECT ` + cols + ` FROM ` + sched + w.sql() + ` ORDER BY due_at, seq LIMIT ` + w.arg(limit+1)
	} else {
		// The matches among the next MaxScheduledScan rows in due order: the inner walk is the
		// index's, the topic is tested on what it returns. (w's conditions are the cursor's
		// only: the topic is an argument of the outer query.)
		sql = `SELECT ` + cols + ` FROM (SELECT * FROM ` + sched + w.sql() + ` ORDER BY due_at, seq LIMIT ` + strconv.Itoa(MaxScheduledScan) + `) s
			WHERE topic = ` + w.arg(f.Topic) + ` ORDER BY due_at, seq LIMIT ` + w.arg(limit+1)
	}
	rows, err := db.Query(ctx, sql, w.args...)
	if err != nil {
		return ScheduledPage{}, a.wrap("list scheduled messages", err)
	}
	msgs, err := pgx.CollectRows(rows, scanScheduled)
	if err != nil {
		return ScheduledPage{}, a.wrap("list scheduled messages", err)
	}
	p := ScheduledPage{Messages: msgs}
	if len(msgs) > limit {
		p.Messages = msgs[:limit]
		last := p.Messages[limit-1]
		p.Next = scheduledCursor{due: last.DueAt, seq: last.Seq}.String()
		return p, nil
	}
	if f.Topic != "" {
		// The page did not fill: was the walk cut at MaxScheduledScan? The last row it read
		// (index only, in the same order) is where the next page goes on.
		var c scheduledCursor
		err := db.QueryRow(ctx, `SELECT due_at, seq FROM `+sched+w.sql()+
			` ORDER BY due_at, seq OFFSET `+strconv.Itoa(MaxScheduledScan-1)+` LIMIT 1`, w.args[:indexed]...).Scan(&c.due, &c.seq)
		switch {
		case errors.Is(err, pgx.ErrNoRows): // the walk read every row there is
		case err != nil:
			return ScheduledPage{}, a.wrap("list scheduled messages", err)
		default:
			p.Next, p.Searched = c.String(), MaxScheduledScan
		}
	}
	return p, nil
}

// ScheduledSummary is what waits in outbox_scheduled, read cheaply enough for a status page or
// a metric: counts that stop at ExactBacklogRows and the head of the due index, never the
// whole table (2.3–8 ms at 1M scheduled rows; see ScheduledPerTopic for what a full count
// costs).
type ScheduledSummary struct {
	// Rows scheduled: exact when Exact (at most ExactBacklogRows); otherwise an estimate,
	// PostgreSQL's live-tuple counter of the table (a second or so late), at least
	// ExactBacklogRows+1.
	Rows  int64
	Exact bool
	// NextDue is the due time of the first message in due order, the next a relay moves
	// (zero when none is scheduled); NextEventID and NextTopic are that message's. In the
	// past only while due messages wait to be moved: see Lag.
	NextDue     time.Time
	NextEventID string
	NextTopic   string
	// Overdue counts the messages due more than ScheduledOverdueAfter ago, up to
	// ExactBacklogRows (OverdueCapped when it stopped there).
	Overdue       int64
	OverdueCapped bool
	// CheckedAt is the database's clock when the figures were read.
	CheckedAt time.Time
}

// Lag is how long the first message in due order is past its due time: 0 when none is due.
// It keeps growing while no relay moves scheduled messages, as Backlog.OldestAge does while
// none publishes.
func (s ScheduledSummary) Lag() time.Duration {
	if s.NextDue.IsZero() {
		return 0
	}
	return max(s.CheckedAt.Sub(s.NextDue), 0)
}

// ScheduledTopicCount counts the scheduled messages of one topic.
type ScheduledTopicCount struct {
	Topic   string
	Rows    int64
	NextDue time.Time // the earliest due time among them
}

// ScheduledSample is the sample ScheduledPerTopic is usually given: the next 10,000 messages in
// due order, read from the head of the due index in 14–24 ms whatever the number of rows.
const ScheduledSample = 10_000

// scheduledCountsSQL reads a ScheduledSummary in one round trip ($1: the counts' cap, $2: the
// table's qualified name, $3: the overdue grace in seconds): a count that stops at $1 rows,
// the statistics counter, a count of the overdue rows that stops at $1, and the first row in
// due order. The capped count walks the due index from its latest end: relays delete moved
// rows from its earliest end, whose dead tuples (until vacuum) a walk from there would wade
// through first. The overdue count is a range of the same index from its earliest end.
func scheduledCountsSQL(schema string) string {
	sched := pgsql.Table(schema, "outbox_scheduled")
	return `WITH head AS (SELECT event_id, topic, due_at FROM ` + sched + ` ORDER BY due_at, seq LIMIT 1)
	SELECT now(),
		(SELECT count(*) FROM (SELECT 1 FROM ` + sched + ` ORDER BY due_at DESC, seq DESC LIMIT $1) s),
		(SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = $2::regclass),
		(SELECT count(*) FROM (SELECT 1 FROM ` + sched + ` WHERE due_at < now() - make_interval(secs => $3::float8)
			ORDER BY due_at, seq LIMIT $1) o),
		(SELECT event_id::text FROM head), (SELECT topic FROM head), (SELECT due_at FROM head)`
}

// readScheduledCounts reads a ScheduledSummary with scheduledCountsSQL.
func readScheduledCounts(ctx context.Context, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, sql, table string) (ScheduledSummary, error) {
	var s ScheduledSummary
	var counted int64
	var live *int64
	var id, topic *string
	var due *time.Time
	if err := db.QueryRow(ctx, sql, ExactBacklogRows+1, table, ScheduledOverdueAfter.Seconds()).
		Scan(&s.CheckedAt, &counted, &live, &s.Overdue, &id, &topic, &due); err != nil {
		return s, err
	}
	if due != nil && id != nil && topic != nil {
		s.NextDue, s.NextEventID, s.NextTopic = *due, *id, *topic
	}
	s.OverdueCapped = s.Overdue > ExactBacklogRows
	s.Overdue = min(s.Overdue, ExactBacklogRows)
	if counted <= ExactBacklogRows {
		s.Rows, s.Exact = counted, true
		return s, nil
	}
	s.Rows = ExactBacklogRows + 1
	if live != nil {
		s.Rows = max(*live, s.Rows)
	}
	return s, nil
}

// ScheduledSummary reads how many messages are scheduled, the next due and the overdue ones
// (see ScheduledSummary) in one statement bounded by the due index whatever the number of rows:
// what `onceflow status` and the relays' metrics read.
func (a *Admin) ScheduledSummary(ctx context.Context, db DB) (ScheduledSummary, error) {
	s, err := readScheduledCounts(ctx, db, scheduledCountsSQL(a.schema), a.scheduledTable())
	if err != nil {
		return s, a.wrap("count scheduled messages", err)
	}
	return s, nil
}

// ScheduledPerTopic counts scheduled messages by topic, most first (at most 100 topics), with
// each topic's earliest due time: among the next sample messages in due order (ScheduledSample
// is the usual one: the topics about to be published), or among all of them when sample is 0.
// A sample is read from the head of the due index, at the same cost at any number of rows; 0
// reads the whole table (no index holds the topic): measured at 1M scheduled rows of 200 B on
// 2 shared cores, 0.5–0.8 s, so it is an operator's question (`onceflow outbox scheduled
// --count --all`), not something to poll.
func (a *Admin) ScheduledPerTopic(ctx context.Context, db DB, sample int) ([]ScheduledTopicCount, error) {
	if sample < 0 {
		return nil, fmt.Errorf("relay: a count by topic needs a sample of 1 or more rows, or 0 for all, not %d", sample)
	}
	from := a.scheduledTable()
	var args []any
	if sample > 0 {
		from, args = `(SELECT topic, due_at FROM `+from+` ORDER BY due_at, seq LIMIT $1) h`, []any{sample}
	}
	rows, err := db.Query(ctx, `SELECT topic, count(*), min(due_at) FROM `+from+` GROUP BY topic ORDER BY count(*) DESC, topic LIMIT 100`, args...)
	if err != nil {
		return nil, a.wrap("count scheduled messages per topic", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[ScheduledTopicCount])
	if err != nil {
		return nil, a.wrap("count scheduled messages per topic", err)
	}
	return out, nil
}

func (a *Admin) scheduledTable() string { return pgsql.Table(a.schema, "outbox_scheduled") }

func scanScheduled(row pgx.CollectableRow) (ScheduledMessage, error) {
	var m ScheduledMessage
	var meta []byte
	err := row.Scan(&m.EventID, &m.Topic, &m.Key, &m.Size, &meta, &m.DueAt, &m.Seq, &m.CreatedAt)
	if err == nil {
		m.Metadata = decodeMetadata(meta)
	}
	return m, err
}

// scheduledCursor is the position after a scheduled message in due order.
type scheduledCursor struct {
	due time.Time
	seq int64
}

// String encodes the cursor for a URL or a command line: the due time in microseconds since
// the epoch (PostgreSQL's precision, so the position is exact) and the seq.
func (c scheduledCursor) String() string {
	return base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatInt(c.due.UnixMicro(), 10) + ":" + strconv.FormatInt(c.seq, 10)))
}

func parseScheduledCursor(s string) (scheduledCursor, error) {
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return scheduledCursor{}, err
	}
	us, seq, ok := strings.Cut(string(b), ":")
	if !ok {
		return scheduledCursor{}, errors.New("no separator")
	}
	n, err1 := strconv.ParseInt(us, 10, 64)
	q, err2 := strconv.ParseInt(seq, 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return scheduledCursor{}, err
	}
	return scheduledCursor{due: time.UnixMicro(n).UTC(), seq: q}, nil
}
