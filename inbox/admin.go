package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgsql"
	cleaning "github.com/onceflow/onceflow/internal/retention"
)

// DB is what Admin reads with: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
type DB interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Admin reads and acts on the inbox's tables for operators (`onceflow inbox`, the console,
// scripts): the messages consumers gave up on (inbox_poison), their replay and deletion, and
// the dedup rows (processed_event). It holds no connection: every method takes the DB (or the
// transaction) to use.
type Admin struct {
	schema    string
	poison    string // quoted inbox_poison
	processed string // quoted processed_event
}

// NewAdmin returns an Admin for the tables in schema ("" = "onceflow").
func NewAdmin(schema string) (*Admin, error) {
	if schema == "" {
		schema = pgsql.DefaultSchema
	}
	if err := pgsql.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("inbox: %w", err)
	}
	return &Admin{schema: schema, poison: pgsql.Table(schema, "inbox_poison"), processed: pgsql.Table(schema, "processed_event")}, nil
}

// PoisonRow is a message a consumer gave up on: one row of inbox_poison. It was recorded in
// the transaction that wrote its dedup row, so its partition moved on and a redelivery is
// skipped.
type PoisonRow struct {
	ID       int64
	Consumer string // inbox.Config.Consumer of the consumer that gave it up
	// DedupKey is the key its dedup row was written under; nil when the message had no
	// usable key (no replay can apply it then).
	DedupKey    *string
	MessageUUID string
	// Source is where it was consumed: topic/partition@offset for a batched consumer, the
	// topic for a router's handler.
	Source   string
	Attempts int       // attempts before it was given up, replays' included
	FailedAt time.Time // when it was last given up
	Error    string    // the last attempt's error
	Metadata map[string]string
	// Payload is the message's payload; nil when it was not asked for
	// (PoisonFilter.WithPayload).
	Payload []byte
	// State is StatePoison, StateReplayRequested, StateReplayed or StateDuplicate.
	State   string
	Replays int // replays applied, successful or failed
	// Refusal is why no replay may apply the row (a saga's reply or command: the saga has its
	// own recovery); nil when one may.
	Refusal *string
	// History holds the row's replay events, oldest first: objects with "at", "event"
	// (requested, replayed, duplicate, failed), and "by", "attempts", "error" where they apply.
	History []map[string]any
}

// poisonCols are the columns a PoisonRow is scanned from (scanPoison), the payload's
// expression left to fill in.
const poisonCols = `id, consumer, dedup_key, message_uuid, source, attempts, failed_at, error, metadata, %s, state, replays, replay_refusal, history`

func (a *Admin) poisonSelect(withPayload bool) string {
	payload := "NULL::bytea"
	if withPayload {
		payload = "payload"
	}
	return `SELECT ` + fmt.Sprintf(poisonCols, payload) + ` FROM ` + a.poison
}

func scanPoison(row pgx.CollectableRow) (PoisonRow, error) {
	var p PoisonRow
	var meta []byte
	err := row.Scan(&p.ID, &p.Consumer, &p.DedupKey, &p.MessageUUID, &p.Source, &p.Attempts, &p.FailedAt, &p.Error, &meta, &p.Payload,
		&p.State, &p.Replays, &p.Refusal, &p.History)
	if err == nil && json.Unmarshal(meta, &p.Metadata) != nil {
		// Shown, not trusted: a row written by hand may hold other JSON than strings.
		p.Metadata = map[string]string{"(undecodable)": string(meta)}
	}
	return p, err
}

// Poison list bounds.
const (
	// DefaultListLimit is PoisonFilter.Limit's default.
	DefaultListLimit = 100
	// MaxListLimit caps one page of Poison, so one call never reads a whole table (rows
	// carry their payloads when asked).
	MaxListLimit = 1000
)

// PoisonFilter selects a page of poison rows for Poison.
type PoisonFilter struct {
	// Consumer selects one consumer's rows; "" every consumer's.
	Consumer string
	// Before continues a listing: only rows with an id below it (the last id of the previous
	// page). 0 starts from the newest row.
	Before int64
	// Limit is the page's size: 0 means DefaultListLimit, at most MaxListLimit.
	Limit int
	// WithPayload reads each row's payload too; without it PoisonRow.Payload is nil.
	WithPayload bool
}

func (f PoisonFilter) check() error {
	var problems []string
	if f.Before < 0 {
		problems = append(problems, fmt.Sprintf("Before is %d; use 0 for the newest rows, or the last id of the previous page", f.Before))
	}
	if f.Limit < 0 || f.Limit > MaxListLimit {
		problems = append(problems, fmt.Sprintf("Limit is %d; use 0 for the default (%d) or 1..%d", f.Limit, DefaultListLimit, MaxListLimit))
	}
	if len(problems) > 0 {
		return fmt.Errorf("inbox: list poison rows: %s", strings.Join(problems, "; "))
	}
	return nil
}

// Poison lists the poison rows f selects, newest first (by id): a page of at most f.Limit
// rows; the next page is f with Before set to the last row's id. It reads a range of
// inbox_poison_consumer_idx (consumer, id) with a consumer, of the primary key without, so a
// page costs the same at any depth.
func (a *Admin) Poison(ctx context.Context, db DB, f PoisonFilter) ([]PoisonRow, error) {
	if err := f.check(); err != nil {
		return nil, err
	}
	limit := f.Limit
	if limit == 0 {
		limit = DefaultListLimit
	}
	w := &where{}
	if f.Consumer != "" {
		w.add("consumer = " + w.arg(f.Consumer))
	}
	if f.Before > 0 {
		w.add("id < " + w.arg(f.Before))
	}
	// Build the text first: w.args must be read after w.arg(limit) appended to it.
	sql := a.poisonSelect(f.WithPayload) + w.sql() + ` ORDER BY id DESC LIMIT ` + w.arg(limit)
	rows, err := db.Query(ctx, sql, w.args...)
	if err != nil {
		return nil, a.wrap("list poison rows", err)
	}
	out, err := pgx.CollectRows(rows, scanPoison)
	if err != nil {
		return nil, a.wrap("list poison rows", err)
	}
	return out, nil
}

// PoisonByID returns the poison row id, with its payload. Its error wraps ErrNoPoisonRow when
// there is none (never recorded, or deleted already).
func (a *Admin) PoisonByID(ctx context.Context, db DB, id int64) (*PoisonRow, error) {
	if id < 1 {
		return nil, fmt.Errorf("inbox: %d is not a poison row id (ids start at 1; `onceflow inbox poison` lists them)", id)
	}
	rows, err := db.Query(ctx, a.poisonSelect(true)+` WHERE id = $1`, id)
	if err != nil {
		return nil, a.wrap("read a poison row", err)
	}
	out, err := pgx.CollectRows(rows, scanPoison)
	if err != nil {
		return nil, a.wrap("read a poison row", err)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("inbox: %w: no poison row with id %d in schema %q (deleted already? `onceflow inbox poison` lists them)", ErrNoPoisonRow, id, a.schema)
	}
	return &out[0], nil
}

// CountPoisonIDs is how many ids CountPoison returns: the first (oldest) of the rows it
// counted, enough for a confirmation page to show which rows a delete takes first.
const CountPoisonIDs = 20

// CountPoison counts the poison rows of consumer ("" = of every consumer) whose error contains
// errorContains (case-insensitive; "" = any), up to max (it stops counting there, so a count
// costs the same with a million rows), and returns the ids of the first (oldest)
// CountPoisonIDs of them. With a consumer it counts exactly the rows DeletePoisonTx deletes
// for DeleteFilter{Consumer: consumer, ErrorContains: errorContains, Limit: max}: both read
// the same selection; a delete refuses the filter without a consumer.
func (a *Admin) CountPoison(ctx context.Context, db DB, consumer, errorContains string, max int) (int64, []int64, error) {
	if max < 1 {
		return 0, nil, fmt.Errorf("inbox: count poison rows: max is %d; give the most rows to count (at least 1)", max)
	}
	w := &where{}
	sel := a.poisonSelection(w, consumer, errorContains)
	sql := `SELECT (SELECT count(*) FROM (` + sel + ` LIMIT ` + w.arg(max) + `) s), ARRAY(` + sel + ` LIMIT ` + strconv.Itoa(CountPoisonIDs) + `)`
	var n int64
	var first []int64
	if err := db.QueryRow(ctx, sql, w.args...).Scan(&n, &first); err != nil {
		return 0, nil, a.wrap("count poison rows", err)
	}
	return n, first, nil
}

// poisonSelection is the one description of the rows a delete by filter takes and
// CountPoison counts: the ids of consumer's rows ("" = every consumer's; DeletePoisonTx
// refuses that) whose error contains errorContains (case-insensitive; "" = any), oldest first,
// on inbox_poison_consumer_idx (consumer, id). The caller appends the LIMIT.
func (a *Admin) poisonSelection(w *where, consumer, errorContains string) string {
	if consumer != "" {
		w.add("consumer = " + w.arg(consumer))
	}
	if errorContains != "" {
		w.add("strpos(lower(error), lower(" + w.arg(errorContains) + "::text)) > 0")
	}
	return `SELECT id FROM ` + a.poison + w.sql() + ` ORDER BY id`
}

// ConsumerPoison is what waits in inbox_poison for one consumer.
type ConsumerPoison struct {
	Consumer string
	// Poison counts the messages given up (state poison): they wait for an operator.
	Poison int64
	// ReplayRequested counts the replay requests waiting for a process of the consumer.
	ReplayRequested int64
	// OldestRequest is when the oldest waiting replay was requested; zero when none waits.
	// A request that waits long has no process of its consumer to apply it.
	OldestRequest time.Time
	// CheckedAt is the database's clock when the figures were read.
	CheckedAt time.Time
}

// OldestRequestAge is how long the oldest waiting replay request has waited, on the
// database's clock (0 when none waits).
func (c ConsumerPoison) OldestRequestAge() time.Duration {
	if c.OldestRequest.IsZero() {
		return 0
	}
	return max(c.CheckedAt.Sub(c.OldestRequest), 0)
}

// PoisonSummary counts, per consumer (in name order), the rows that wait: given up, or with
// a replay requested. Replayed (and duplicate) rows are history, not problems, and are not
// counted. inbox_poison holds only given-up messages, which an operator deletes once handled:
// a small table, counted in full.
func (a *Admin) PoisonSummary(ctx context.Context, db DB) ([]ConsumerPoison, error) {
	rows, err := db.Query(ctx, `SELECT consumer, count(*) FILTER (WHERE state = 'poison'), count(*) FILTER (WHERE state = 'replay_requested'),
		min(replay_requested_at) FILTER (WHERE state = 'replay_requested'), now()
		FROM `+a.poison+` WHERE state IN ('poison', 'replay_requested') GROUP BY consumer ORDER BY consumer`)
	if err != nil {
		return nil, a.wrap("count poison rows per consumer", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (ConsumerPoison, error) {
		var c ConsumerPoison
		var oldest *time.Time
		err := row.Scan(&c.Consumer, &c.Poison, &c.ReplayRequested, &oldest, &c.CheckedAt)
		if oldest != nil {
			c.OldestRequest = *oldest
		}
		return c, err
	})
	if err != nil {
		return nil, a.wrap("count poison rows per consumer", err)
	}
	return out, nil
}

// Processed looks up consumer's dedup row of dedupKey: ok is true, with the time it was
// written, when the consumer applied the message; false when it has not (yet), or its row
// expired with the retention window (Cleaner). One primary-key probe.
func (a *Admin) Processed(ctx context.Context, db DB, consumer, dedupKey string) (processedAt time.Time, ok bool, err error) {
	if consumer == "" || dedupKey == "" {
		return time.Time{}, false, errors.New("inbox: dedup rows are keyed per consumer: give the consumer and the dedup key")
	}
	err = db.QueryRow(ctx, `SELECT processed_at FROM `+a.processed+` WHERE consumer = $1 AND dedup_key = $2`, consumer, dedupKey).Scan(&processedAt)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return time.Time{}, false, nil
	case err != nil:
		return time.Time{}, false, a.wrap("look up a dedup row", err)
	}
	return processedAt, true, nil
}

// Expired counts the dedup rows older than window that Cleaner would delete now, up to max
// (it stops counting there: "max or more"), on the database's clock. Like Cleaner, it leaves
// out a live saga's barrier rows (kept however old). With barriersElsewhere — the sagas live in
// another database (CleanerConfig.Sagas, `cleanup --saga-database-url`) — it counts no
// barrier row at all: which of them go is asked of that database during the cleanup.
func (a *Admin) Expired(ctx context.Context, db DB, window time.Duration, max int64, barriersElsewhere bool) (int64, error) {
	var problems []string
	if window <= 0 {
		problems = append(problems, fmt.Sprintf("window is %s; give the retention window (e.g. %s)", window, DefaultWindow))
	}
	if max < 1 {
		problems = append(problems, fmt.Sprintf("max is %d; give the most rows to count (at least 1)", max))
	}
	if len(problems) > 0 {
		return 0, fmt.Errorf("inbox: count expired dedup rows: %s", strings.Join(problems, "; "))
	}
	var n int64
	if err := db.QueryRow(ctx, `SELECT count(*) FROM (SELECT 1 FROM `+a.processed+` WHERE processed_at < now() - make_interval(secs => $1) AND `+
		keptBarriersOut(a.schema, barriersElsewhere)+` LIMIT $2) s`, window.Seconds(), max).Scan(&n); err != nil {
		return 0, a.wrap("count expired dedup rows", err)
	}
	return n, nil
}

// keptBarriersOut is the condition, on a processed_event row (column saga_id, unqualified),
// that the cleaner may delete it once expired: not a barrier row of a saga alive in schema's
// saga table or, with elsewhere (the sagas live in another database, asked separately), not a
// barrier row at all. Cleaner and Expired both use it, so a count is what a cleanup deletes.
//
// Nor is the dedup row of a message parked in the retry lane (inbox_parked, RetryAfter): the
// lane applies it later by its parked row, and a redelivery in between must stay a duplicate
// however long the lane waits. NOT IN over the parked rows is one hashed scan of that table (it
// holds the lanes' waiting messages only) per statement.
func keptBarriersOut(schema string, elsewhere bool) string {
	parked := ` AND (consumer, dedup_key) NOT IN (SELECT x.consumer, x.dedup_key FROM ` + pgsql.Table(schema, "inbox_parked") + ` x)`
	if elsewhere {
		return `saga_id IS NULL` + parked
	}
	return cleaning.NotLiveBarrier(schema) + parked
}

func (a *Admin) wrap(what string, err error) error {
	if pgsql.IsUndefinedTable(err) || pgsql.IsUndefinedColumn(err) {
		return fmt.Errorf("inbox: %s: schema %q is not migrated; run `onceflow migrate up --schema %s`: %w", what, a.schema, a.schema, err)
	}
	return fmt.Errorf("inbox: %s in schema %q: %w", what, a.schema, err)
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
