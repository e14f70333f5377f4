package relay

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgsql"
)

// ExactBacklogRows is how many outbox rows Backlog counts exactly; above it the figure is an
// estimate. Counting stops there, so sampling costs the same with 10 thousand or 10 million
// rows waiting (see docs/operations.md, "Backlog").
const ExactBacklogRows = 10_000

// Backlog is what waits in an outbox, read cheaply enough to sample every few seconds and
// to alert on: no count(*) over the whole table (at 1M waiting rows one takes tens to
// hundreds of milliseconds and reads every page).
type Backlog struct {
	// Rows waiting. Exact when Exact is true (at most ExactBacklogRows); otherwise an
	// estimate: PostgreSQL's live-tuple counter of the table (pg_stat_user_tables.n_live_tup,
	// kept current by inserts and deletes, a second or so late), kept between
	// ExactBacklogRows and the id span (max(id) − min(id) + 1).
	Rows  int64
	Exact bool
	// OldestID and Oldest are the id and creation time of the row with the lowest id, the
	// next the relays must publish (0 and zero when the outbox is empty). Its age is how far
	// behind publishing is: with one stuck key it keeps growing while the rest flows.
	OldestID int64
	Oldest   time.Time
	// NewestID is the highest id waiting (0 when empty).
	NewestID int64
	// Parked rows in outbox_parked, counted exactly up to ExactBacklogRows (more is reported
	// as ExactBacklogRows: any at all needs an operator).
	Parked int64
	// CheckedAt is the database's clock when the figures were read.
	CheckedAt time.Time
}

// OldestAge is how long the oldest waiting row has waited (0 when none).
func (b Backlog) OldestAge() time.Duration {
	if b.OldestID == 0 || b.Oldest.IsZero() {
		return 0
	}
	return max(b.CheckedAt.Sub(b.Oldest), 0)
}

// backlogSQL reads a Backlog in one round trip ($1: the count's cap, $2: the outbox's
// qualified name): two primary-key endpoint lookups, a count that stops at $1 rows, the
// statistics counter and a capped count of parked rows. The capped count walks the primary
// key from the newest end: relays delete from the oldest end, whose dead tuples (until
// vacuum) a scan from there would wade through first. Measured with `make bench
// BENCH_FLAGS=-only=stats` (docs/operations.md).
func backlogSQL(schema string) string {
	outbox := pgsql.Table(schema, "outbox")
	parked := pgsql.Table(schema, "outbox_parked")
	return `WITH head AS (SELECT id, created_at FROM ` + outbox + ` ORDER BY id LIMIT 1),
	tail AS (SELECT id FROM ` + outbox + ` ORDER BY id DESC LIMIT 1)
	SELECT now(),
		(SELECT count(*) FROM (SELECT 1 FROM ` + outbox + ` ORDER BY id DESC LIMIT $1) s),
		(SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = $2::regclass),
		coalesce((SELECT id FROM head), 0), (SELECT created_at FROM head), coalesce((SELECT id FROM tail), 0),
		(SELECT count(*) FROM (SELECT 1 FROM ` + parked + ` LIMIT $1) p)`
}

// Backlog reads the outbox's backlog without counting it (see Backlog).
func (a *Admin) Backlog(ctx context.Context, db DB) (Backlog, error) {
	b, err := readBacklog(ctx, db, backlogSQL(a.schema), a.q.outbox)
	if err != nil {
		return b, a.wrap("read the outbox backlog", err)
	}
	return b, nil
}

func readBacklog(ctx context.Context, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, sql, table string) (Backlog, error) {
	var b Backlog
	var counted int64
	var live *int64
	var oldest *time.Time
	if err := db.QueryRow(ctx, sql, ExactBacklogRows+1, table).Scan(&b.CheckedAt, &counted, &live, &b.OldestID, &oldest, &b.NewestID, &b.Parked); err != nil {
		return b, err
	}
	if oldest != nil {
		b.Oldest = *oldest
	}
	b.Parked = min(b.Parked, ExactBacklogRows)
	if counted <= ExactBacklogRows {
		b.Rows, b.Exact = counted, true
		return b, nil
	}
	span := b.NewestID - b.OldestID + 1
	b.Rows = span
	if live != nil {
		b.Rows = min(max(*live, ExactBacklogRows+1), span)
	}
	return b, nil
}
