package saga

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
	"github.com/onceflow/onceflow/outbox"
)

// DB runs the admin queries: a *pgxpool.Pool, *pgx.Conn or pgx.Tx.
type DB interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Admin reads sagas and files operator requests, for `onceflow saga` and health pages. It
// needs no definition: requests (RetryTx, CompensateTx) are carried out by an orchestrator
// that has the saga's definition, through the timer table, within its TimerInterval. Given
// the definitions (NewAdmin's defs), it refuses up front what the orchestrator would drop:
// a compensation past a saga's pivot.
type Admin struct {
	st   store
	defs map[knownKey]Known
}

type knownKey struct {
	name    string
	version int
}

// Known is a saga definition an Admin may be given: any *Definition[D].
type Known interface {
	Name() string
	Version() int
	pivotIndex() int
}

// NewAdmin returns an Admin for the saga tables of schema ("" = "onceflow"). defs are the
// definitions the service runs, if the caller has them (a console mounted in the service):
// with a saga's definition known, CompensateTx refuses a saga past its pivot.
func NewAdmin(schema string, defs ...Known) (*Admin, error) {
	if schema == "" {
		schema = pgsql.DefaultSchema
	}
	if err := pgsql.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("saga: %w", err)
	}
	a := &Admin{st: newStore(schema), defs: map[knownKey]Known{}}
	for _, d := range defs {
		if d == nil {
			return nil, errors.New("saga: NewAdmin: a nil definition")
		}
		a.defs[knownKey{d.Name(), d.Version()}] = d
	}
	return a, nil
}

// Summary is one saga in a list.
type Summary struct {
	ID        string
	Name      string
	Version   int
	State     State
	Step      string // the current step (being run or compensated), or the last one when finished
	Attempt   int
	Error     string
	CreatedAt time.Time
	UpdatedAt time.Time
}

// Detail is one saga with its data, step history, pending timers and what it waits for.
type Detail struct {
	Summary
	Data   json.RawMessage
	Steps  []StepHistory
	Timers []Timer
	// Wait says what the saga waits for; nil when it has finished.
	Wait *Wait
	// CheckedAt is the database's clock when the saga was read: compare Wait.Since and the
	// timers with it, not with the local clock.
	CheckedAt time.Time
	// TraceParent is the W3C traceparent of the caller of StartTx ("" when it had none):
	// its trace id finds the saga's spans in a tracing backend.
	TraceParent string
	// ParkedReplies counts the saga's replies that reached orchestrators lacking its
	// definition version and wait, parked, for one that has it (a rolling deploy: see
	// docs/sagas.md, "Rolling deploys: versions side by side"); Wait.For is WaitVersion
	// while there are any. AwaitingVersion is then the version they await (the saga's
	// own, Version), 0 when none is parked.
	ParkedReplies   int
	AwaitingVersion int
}

// ParkedVersion counts the parked replies of one definition version (Admin.ParkedByVersion).
type ParkedVersion struct {
	Name    string
	Version int
	// Replies and Sagas count the parked replies and the sagas they belong to.
	Replies, Sagas int64
	// Oldest is when the oldest of them parked, CheckedAt the database's clock when they were
	// counted: a wait that keeps growing means no running orchestrator has the version.
	Oldest, CheckedAt time.Time
}

// ParkedByVersion counts the parked replies per definition name and version, for `onceflow
// status`: replies that reached orchestrators without their saga's version registered, which
// an orchestrator that has it applies (docs/sagas.md, "Rolling deploys: versions side by
// side"). The table holds rows only while a deploy is under way, so it is counted in full.
func (a *Admin) ParkedByVersion(ctx context.Context, db DB) ([]ParkedVersion, error) {
	rows, err := db.Query(ctx, a.st.park.byVersion)
	if err != nil {
		return nil, fmt.Errorf("saga: count parked replies: %w", a.st.explain(err))
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[ParkedVersion])
	if err != nil {
		return nil, fmt.Errorf("saga: count parked replies: %w", a.st.explain(err))
	}
	return out, nil
}

// Timer is a pending timer of a saga.
type Timer struct {
	Kind   string // step, deadline or operator
	Action string // timeout, resend, deadline, retry or compensate
	Step   string
	Due    time.Time
}

// ListFilter selects sagas; zero fields match everything. Filters combine with AND.
type ListFilter struct {
	State   State
	Name    string // definition name
	Version int    // definition version; 0: any
	// Step is the name of the current step (being run or compensated; the last one when
	// finished).
	Step string
	// Error matches sagas whose error contains this text, ignoring case.
	Error string
	// IDPrefix matches sagas whose id starts with it.
	IDPrefix string
	// StartedBefore matches sagas started before this time (to list those older than an age).
	StartedBefore time.Time
	// After continues a listing after the last saga of a page: the Page.Next it returned.
	After string
	// Limit is the page size: default 100, at most MaxListLimit.
	Limit int
}

// MaxListLimit caps a page of List and ListPage, so one call never reads a million rows.
const MaxListLimit = 1000

// ErrBadFilter is returned for a ListFilter that cannot select anything meaningful: an
// unknown state, a negative version or limit, a cursor (After) that no page returned.
var ErrBadFilter = errors.New("saga: bad list filter")

// Page is one page of sagas, newest first.
type Page struct {
	Sagas []Summary
	// Next is the ListFilter.After of the following page; "" when this page is the last.
	Next string
	// Searched is set (to MaxListScan) when the page ended because it read that many sagas
	// for a step, error or id-prefix filter without filling up: more may match further on,
	// and Next goes on from the last saga read.
	Searched int
}

// List returns the first page of sagas matching f, newest first (see ListPage).
func (a *Admin) List(ctx context.Context, db DB, f ListFilter) ([]Summary, error) {
	p, err := a.ListPage(ctx, db, f)
	return p.Sagas, err
}

// ListPage returns one page of sagas matching f, newest first, and the cursor of the next.
// Pages are keyset-paginated on (created_at, id), on the indexes of migration 0011: a page
// deep in a million sagas costs what the first one does.
func (a *Admin) ListPage(ctx context.Context, db DB, f ListFilter) (Page, error) {
	var problems []string
	switch f.State {
	case "", StateRunning, StateCompensating, StateCompleted, StateCompensated, StateStuck:
	default:
		problems = append(problems, fmt.Sprintf("state %q is not a saga state (running, compensating, completed, compensated, stuck)", f.State))
	}
	if f.Version < 0 {
		problems = append(problems, fmt.Sprintf("version %d is negative", f.Version))
	}
	switch {
	case f.Limit == 0:
		f.Limit = 100
	case f.Limit < 0 || f.Limit > MaxListLimit:
		problems = append(problems, fmt.Sprintf("limit %d is not between 1 and %d", f.Limit, MaxListLimit))
	}
	var after *cursor
	if f.After != "" {
		c, err := parseCursor(f.After)
		if err != nil {
			problems = append(problems, err.Error())
		}
		after = &c
	}
	if len(problems) > 0 {
		return Page{}, fmt.Errorf("%w: %s", ErrBadFilter, strings.Join(problems, "; "))
	}
	// conds use the indexes (state, created_at); scanned ones (step, error, id prefix) are
	// tested on at most MaxListScan rows per page, so a filter that matches little never reads
	// the whole table: the page then ends early and its Next continues the search.
	var conds, scanned []string
	// The indexed conditions' arguments come first ($1…), so the scan's position query
	// (below) shares them; the page size and the scanned conditions' follow.
	var args []any
	arg := func(v any) string { args = append(args, v); return fmt.Sprintf("$%d", len(args)) }
	if f.State != "" {
		conds = append(conds, "state = "+arg(string(f.State)))
	}
	if f.Name != "" {
		conds = append(conds, "name = "+arg(f.Name))
	}
	if f.Version != 0 {
		conds = append(conds, "version = "+arg(f.Version))
	}
	if !f.StartedBefore.IsZero() {
		conds = append(conds, "created_at < "+arg(f.StartedBefore))
	}
	if after != nil {
		conds = append(conds, "(created_at, id) < ("+arg(after.at)+", "+arg(after.id)+")")
	}
	indexed := len(args)
	limit := arg(f.Limit + 1)
	if f.Step != "" {
		scanned = append(scanned, "steps -> step ->> 'name' = "+arg(f.Step))
	}
	if f.Error != "" {
		scanned = append(scanned, "strpos(lower(error), lower("+arg(f.Error)+")) > 0")
	}
	if f.IDPrefix != "" {
		scanned = append(scanned, "starts_with(id, "+arg(f.IDPrefix)+")")
	}
	where := ""
	if len(conds) > 0 {
		where = " WHERE " + strings.Join(conds, " AND ")
	}
	const cols = `id, name, version, state, step, attempt, error, steps -> step ->> 'name', created_at, updated_at`
	table := pgsql.Table(a.st.schema, "saga")
	query := `SELECT ` + cols + ` FROM ` + table + where + ` ORDER BY created_at DESC, id DESC LIMIT ` + limit
	if len(scanned) > 0 {
		// The matches among the next MaxListScan rows, read in order until the page fills.
		query = `SELECT ` + cols + ` FROM (SELECT * FROM ` + table + where + ` ORDER BY created_at DESC, id DESC LIMIT ` + strconv.Itoa(MaxListScan) + `) s
			WHERE ` + strings.Join(scanned, " AND ") + ` ORDER BY created_at DESC, id DESC LIMIT ` + limit
	}
	rows, err := db.Query(ctx, query, args...)
	if err != nil {
		return Page{}, fmt.Errorf("saga: list: %w", a.st.explain(err))
	}
	out := []Summary{}
	for rows.Next() {
		var s Summary
		var step int
		var name *string
		if err := rows.Scan(&s.ID, &s.Name, &s.Version, &s.State, &step, &s.Attempt, &s.Error, &name, &s.CreatedAt, &s.UpdatedAt); err != nil {
			rows.Close()
			return Page{}, fmt.Errorf("saga: list: %w", a.st.explain(err))
		}
		s.Step = fmt.Sprintf("#%d", step)
		if name != nil {
			s.Step = *name
		}
		out = append(out, s)
	}
	if err := rows.Err(); err != nil {
		return Page{}, fmt.Errorf("saga: list: %w", a.st.explain(err))
	}
	p := Page{Sagas: out}
	if len(out) > f.Limit {
		p.Sagas = out[:f.Limit]
		last := p.Sagas[f.Limit-1]
		p.Next = cursor{at: last.CreatedAt, id: last.ID}.String()
		return p, nil
	}
	if len(scanned) > 0 {
		// The page did not fill: was the scan cut at MaxListScan? The last row it read
		// (index only, on the same order) is where the next page goes on.
		var c cursor
		err := db.QueryRow(ctx, `SELECT created_at, id FROM `+table+where+` ORDER BY created_at DESC, id DESC OFFSET `+strconv.Itoa(MaxListScan-1)+` LIMIT 1`,
			args[:indexed]...).Scan(&c.at, &c.id)
		switch {
		case errors.Is(err, pgx.ErrNoRows): // the scan read every row there is
		case err != nil:
			return Page{}, fmt.Errorf("saga: list: %w", a.st.explain(err))
		default:
			p.Next, p.Searched = c.String(), MaxListScan
		}
	}
	return p, nil
}

// MaxListScan bounds the rows one page of List reads for a filter on the step, the error or
// an id prefix, which no index answers: a page that found fewer matches ends there
// (Page.Searched), and its Next goes on with the search.
const MaxListScan = 20_000

// cursor is the position after a saga in the list order (created_at DESC, id DESC).
type cursor struct {
	at time.Time
	id string
}

// String encodes the cursor for a URL: microseconds since the epoch (PostgreSQL's
// precision, so the position is exact) and the id.
func (c cursor) String() string {
	return base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatInt(c.at.UnixMicro(), 10) + ":" + c.id))
}

func parseCursor(s string) (cursor, error) {
	bad := fmt.Errorf("cursor %q is not one a page of sagas returned", s)
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return cursor{}, bad
	}
	us, id, ok := strings.Cut(string(b), ":")
	n, err := strconv.ParseInt(us, 10, 64)
	if !ok || err != nil {
		return cursor{}, bad
	}
	return cursor{at: time.UnixMicro(n).UTC(), id: id}, nil
}

// Alive returns those of ids whose sagas are alive: running, compensating or stuck (a saga
// removed by the retention cleanup, or never started here, is not). It is what a saga
// participant's inbox.Cleaner asks (inbox.CleanerConfig.Sagas) when the orchestrator keeps
// its sagas in another database, so that the participant keeps their barrier rows:
//
//	Sagas: func(ctx context.Context, ids []string) ([]string, error) {
//		return admin.Alive(ctx, orchestratorPool, ids)
//	},
func (a *Admin) Alive(ctx context.Context, db DB, ids []string) ([]string, error) {
	rows, err := db.Query(ctx, `SELECT id FROM `+pgsql.Table(a.st.schema, "saga")+` WHERE id = ANY($1::text[]) AND finished_at IS NULL`, ids)
	if err != nil {
		return nil, fmt.Errorf("saga: which of %d sagas are alive: %w", len(ids), a.st.explain(err))
	}
	alive, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("saga: which of %d sagas are alive: %w", len(ids), a.st.explain(err))
	}
	return alive, nil
}

// ErrNotFound is returned for a saga id without a row (never started, or removed by the
// retention cleanup after it finished).
var ErrNotFound = errors.New("saga: no saga with this id")

// Get returns one saga with its history, its timers and what it waits for (Detail.Wait).
// For a saga waiting for a reply it looks the current command up in the outbox and
// outbox_parked by index probes, at any backlog: the saga row records the transaction that
// wrote the command, and the outbox has a b-tree on tx (see Wait). A saga whose last command
// was written before migration 0019 is looked up by event id, which has no index (a second
// b-tree would cost every business commit): behind a backlog older than the command that is
// one scan of the outbox, as `onceflow outbox find` does.
func (a *Admin) Get(ctx context.Context, db DB, id string) (*Detail, error) {
	in, now, err := a.st.load(ctx, db, id, false)
	if errors.Is(err, errNoSaga) {
		return nil, fmt.Errorf("%w: %q", ErrNotFound, id)
	}
	if err != nil {
		return nil, err
	}
	d := &Detail{Summary: summaryOf(in), Data: in.Data, Steps: in.Steps, CheckedAt: now, TraceParent: in.Trace["traceparent"]}
	rows, err := db.Query(ctx, `SELECT kind, action, step, due_at FROM `+pgsql.Table(a.st.schema, "saga_timer")+` WHERE saga_id = $1 ORDER BY due_at`, id)
	if err != nil {
		return nil, fmt.Errorf("saga: timers of %q: %w", id, a.st.explain(err))
	}
	d.Timers, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (Timer, error) {
		var t Timer
		var step int
		err := r.Scan(&t.Kind, &t.Action, &step, &t.Due)
		if t.Kind == timerStep && step >= 0 && step < len(in.Steps) {
			t.Step = in.Steps[step].Name
		}
		return t, err
	})
	if err != nil {
		return nil, fmt.Errorf("saga: timers of %q: %w", id, a.st.explain(err))
	}
	var p parkedInfo
	if err := db.QueryRow(ctx, a.st.park.count, id).Scan(&p.count, &p.since, &p.lastError); err != nil {
		return nil, fmt.Errorf("saga: parked replies of %q: %w", id, a.st.explain(err))
	}
	if d.ParkedReplies = p.count; p.count > 0 {
		d.AwaitingVersion = in.Version
	}
	if d.Wait, err = a.wait(ctx, db, in, d.Timers, p); err != nil {
		return nil, err
	}
	return d, nil
}

func summaryOf(in *instance) Summary {
	s := Summary{ID: in.ID, Name: in.Name, Version: in.Version, State: in.State, Attempt: in.Attempt,
		Error: in.Error, CreatedAt: in.CreatedAt, UpdatedAt: in.UpdatedAt}
	if in.Step >= 0 && in.Step < len(in.Steps) {
		s.Step = in.Steps[in.Step].Name
	}
	return s
}

// ErrWrongState is returned by RetryTx and CompensateTx when the saga is not in a state the
// request applies to.
var ErrWrongState = errors.New("saga: the request does not apply to the saga's state")

// RetryTx asks the orchestrator to resume a stuck saga the way it was going, with a fresh
// attempt budget: a saga stuck while compensating (its compensation ran out of attempts) gets
// that compensation re-sent; a saga stuck moving forward (a reply that could not be applied,
// a timer that failed) gets its current step's command re-sent as a new attempt — a
// participant answers a later attempt of an action that already took effect with the result
// it kept, without running it again, however long the saga was stuck (the participants'
// barrier rows are kept while it lives). A saga stuck moving forward whose saga-wide deadline
// (WithDeadline) passed meanwhile compensates instead, as the deadline would have made it.
// Get's Wait.Phase says which. Fix the cause first (the error is in Get's Error and the
// step's LastError).
func (a *Admin) RetryTx(ctx context.Context, tx pgx.Tx, id string) error {
	return a.request(ctx, tx, id, actRetry, a.canRetry)
}

// canRetry refuses a retry of a saga that is not stuck.
func (a *Admin) canRetry(in *instance) error {
	if in.State != StateStuck {
		return refused(ErrWrongState, in.ID, "is %s; only a stuck saga can be retried", in.State)
	}
	return nil
}

// ErrPastPivot is returned by CompensateTx for a saga on or past its pivot step: it can only
// go forward, and the orchestrator would drop the request. It wraps ErrWrongState.
var ErrPastPivot = fmt.Errorf("%w: the saga is past its pivot", ErrWrongState)

// Refusal is the error a request for one saga is refused with (RetryTx, CompensateTx, the
// bulk and upgrade requests): errors.Is matches its Kind (ErrWrongState, ErrPastPivot,
// ErrNoLongerMatches or ErrNotUpgradable), and Reason says why in words that follow the
// saga's id, for lists that name the saga already ("is running; only a stuck saga can be
// retried").
type Refusal struct {
	ID     string
	Kind   error
	Reason string
}

func (e *Refusal) Error() string { return fmt.Sprintf("%v: saga %q: %s", e.Kind, e.ID, e.Reason) }

// Unwrap returns Kind.
func (e *Refusal) Unwrap() error { return e.Kind }

func refused(kind error, id, format string, args ...any) error {
	return &Refusal{ID: id, Kind: kind, Reason: fmt.Sprintf(format, args...)}
}

// CompensateTx asks the orchestrator to stop a running saga and compensate the steps that took
// effect (including the current one: the barrier makes that a no-op if its action never ran).
// A saga past its pivot cannot be compensated: it is refused with ErrPastPivot when the Admin
// knows the saga's definition (NewAdmin's defs) or the saga's history records its pivot (every
// saga started since that was added); for older sagas the orchestrator drops the request (and
// logs it).
func (a *Admin) CompensateTx(ctx context.Context, tx pgx.Tx, id string) error {
	return a.request(ctx, tx, id, actCompensate, a.canCompensate)
}

// canCompensate refuses a compensation of a saga that is not running or is past its pivot.
func (a *Admin) canCompensate(in *instance) error {
	if in.State != StateRunning {
		return refused(ErrWrongState, in.ID, "is %s; only a running saga can be compensated", in.State)
	}
	p := recordedPivot(in) // sagas started since the pivot is recorded with them
	if d, ok := a.defs[knownKey{in.Name, in.Version}]; ok {
		p = d.pivotIndex()
	}
	if p >= 0 && p < len(in.Steps) && in.Step >= p {
		return refused(ErrPastPivot, in.ID, "is at step %q, on or after its pivot %q, and can only go forward; "+
			"a compensation would be dropped (fix what blocks the step instead)", in.Steps[in.Step].Name, in.Steps[p].Name)
	}
	return nil
}

// recordedPivot is the index of the step the saga's history marks as its pivot, or −1.
func recordedPivot(in *instance) int {
	for i, s := range in.Steps {
		if s.Pivot {
			return i
		}
	}
	return -1
}

// PastPivot reports whether the saga is on or past its pivot (so CompensateTx would refuse
// it); known is false when neither the Admin knows the definition nor the saga's history
// records its pivot.
func (a *Admin) PastPivot(d *Detail) (past, known bool) {
	pivot := -1
	for i, s := range d.Steps {
		if s.Pivot {
			pivot = i
		}
	}
	if def, ok := a.defs[knownKey{d.Name, d.Version}]; ok {
		pivot = def.pivotIndex()
	} else if pivot < 0 {
		return false, false
	}
	for i, s := range d.Steps {
		if s.Name == d.Step && !d.State.Finished() {
			return i >= pivot, true
		}
	}
	return false, true
}

func (a *Admin) request(ctx context.Context, tx pgx.Tx, id, action string, check func(*instance) error) error {
	in, _, err := a.st.load(ctx, tx, id, true)
	if errors.Is(err, errNoSaga) {
		return fmt.Errorf("%w: %q", ErrNotFound, id)
	}
	if err != nil {
		return err
	}
	if err := check(in); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, a.st.insOpr, id, action); err != nil {
		return fmt.Errorf("saga: file the %s request for %q: %w", action, id, a.st.explain(err))
	}
	if err := audit.RecordTx(ctx, tx, a.st.schema, "saga "+action, []string{id}, "requested"); err != nil {
		return fmt.Errorf("saga: %w", a.st.explain(err))
	}
	return nil
}

// TxDB is what the bulk requests need: a DB that begins transactions (a *pgxpool.Pool).
type TxDB interface {
	DB
	Begin(ctx context.Context) (pgx.Tx, error)
}

// BulkOptions bound RetryMatching and CompensateMatching.
type BulkOptions struct {
	// DryRun lists the sagas the filter selects (up to Limit) and files nothing.
	DryRun bool
	// Limit is the most sagas acted on (or listed) in one call: default 100, at most
	// MaxBulkLimit. BulkResult.More says whether the filter selects more.
	Limit int
	// IDs, when set, are the sagas to act on — those a dry run listed and an operator
	// confirmed — instead of what the filter selects now (at most Limit). Either way each
	// saga is acted on only if it still matches the whole filter once its row is locked;
	// one that moved on since it was listed is refused with ErrNoLongerMatches.
	IDs []string
}

// ErrNoLongerMatches is the refusal of a saga a bulk request selected (or was given) that no
// longer matches the request's filter when its row is locked: it moved on since it was
// listed. Nothing is filed for it. It wraps ErrWrongState.
var ErrNoLongerMatches = fmt.Errorf("%w: the saga no longer matches the filter", ErrWrongState)

// describe says what f selects, for the audit record of a bulk request.
func (f ListFilter) describe() string {
	var parts []string
	add := func(name, v string) {
		if v != "" {
			parts = append(parts, name+" "+strconv.Quote(v))
		}
	}
	add("state", string(f.State))
	add("name", f.Name)
	if f.Version != 0 {
		parts = append(parts, "version "+strconv.Itoa(f.Version))
	}
	add("step", f.Step)
	add("error containing", f.Error)
	add("id prefix", f.IDPrefix)
	if !f.StartedBefore.IsZero() {
		parts = append(parts, "started before "+f.StartedBefore.UTC().Format(time.RFC3339))
	}
	return strings.Join(parts, ", ")
}

// mismatch says why in does not match f, as ListPage's query decides; "" when it does.
func (f ListFilter) mismatch(in *instance) string {
	s := summaryOf(in)
	switch {
	case f.State != "" && s.State != f.State:
		return fmt.Sprintf("is %s now, not %s", s.State, f.State)
	case f.Name != "" && s.Name != f.Name:
		return fmt.Sprintf("is a %s saga, not %s", s.Name, f.Name)
	case f.Version != 0 && s.Version != f.Version:
		return fmt.Sprintf("runs version %d, not %d", s.Version, f.Version)
	case f.Step != "" && s.Step != f.Step:
		return fmt.Sprintf("is at step %s now, not %s", s.Step, f.Step)
	case f.Error != "" && !strings.Contains(strings.ToLower(s.Error), strings.ToLower(f.Error)):
		return fmt.Sprintf("has no error containing %q now", f.Error)
	case f.IDPrefix != "" && !strings.HasPrefix(s.ID, f.IDPrefix):
		return fmt.Sprintf("has no id starting with %q", f.IDPrefix)
	case !f.StartedBefore.IsZero() && !s.CreatedAt.Before(f.StartedBefore):
		return fmt.Sprintf("started at %s, not before %s", s.CreatedAt.UTC().Format(time.RFC3339), f.StartedBefore.UTC().Format(time.RFC3339))
	}
	return ""
}

// MaxBulkLimit caps one bulk request: a larger recovery is several calls, each reported.
const MaxBulkLimit = 10_000

// BulkRefusal is a saga a bulk request did not apply to, and why.
type BulkRefusal struct {
	ID  string
	Err error // wraps ErrWrongState, ErrPastPivot, ErrNotUpgradable or ErrNotFound
}

// Reason is why the saga was refused, in words that follow its id: the Refusal's Reason, or
// the error's text for another failure (a saga not found).
func (r BulkRefusal) Reason() string {
	if rf := (*Refusal)(nil); errors.As(r.Err, &rf) {
		return rf.Reason
	}
	return r.Err.Error()
}

// BulkResult reports a bulk request saga by saga.
type BulkResult struct {
	// Matched are the ids the filter selected, newest first, at most Limit.
	Matched []string
	// More is set when the filter selects more sagas than Limit.
	More bool
	// Requested are the sagas whose request was filed (none on a dry run).
	Requested []string
	// Refused are the sagas the request does not apply to (their state changed since they
	// were listed, or past the pivot), each with the reason; nothing was filed for them.
	Refused []BulkRefusal
}

// RetryMatching files a retry request (RetryTx) for each saga f selects, in its own
// transaction, so each saga is requested or refused as a whole and one refusal stops
// nothing else. f.After and f.Limit are ignored: o.Limit bounds the call.
func (a *Admin) RetryMatching(ctx context.Context, db TxDB, f ListFilter, o BulkOptions) (BulkResult, error) {
	return a.bulk(ctx, db, f, o, actRetry, a.canRetry)
}

// CompensateMatching files a compensation request (CompensateTx) for each saga f selects,
// as RetryMatching does.
func (a *Admin) CompensateMatching(ctx context.Context, db TxDB, f ListFilter, o BulkOptions) (BulkResult, error) {
	return a.bulk(ctx, db, f, o, actCompensate, a.canCompensate)
}

func (a *Admin) bulk(ctx context.Context, db TxDB, f ListFilter, o BulkOptions, action string, check func(*instance) error) (BulkResult, error) {
	var res BulkResult
	switch {
	case o.Limit == 0:
		o.Limit = 100
	case o.Limit < 0 || o.Limit > MaxBulkLimit:
		return res, fmt.Errorf("%w: limit %d is not between 1 and %d", ErrBadFilter, o.Limit, MaxBulkLimit)
	case len(o.IDs) > o.Limit:
		return res, fmt.Errorf("%w: %d ids given, more than the limit %d", ErrBadFilter, len(o.IDs), o.Limit)
	}
	// Select first, in pages (each bounded by the keyset indexes), then act: the selection is
	// what the filter matched when the call began (or the ids given, what it matched when
	// they were listed), and acting does not move the pages.
	f.After = ""
	if len(o.IDs) > 0 {
		res.Matched = slices.Clone(o.IDs)
	}
	for len(o.IDs) == 0 && len(res.Matched) < o.Limit {
		f.Limit = min(MaxListLimit, o.Limit-len(res.Matched)+1)
		p, err := a.ListPage(ctx, db, f)
		if err != nil {
			return res, err
		}
		for _, s := range p.Sagas {
			if len(res.Matched) == o.Limit {
				res.More = true
				break
			}
			res.Matched = append(res.Matched, s.ID)
		}
		if p.Next == "" || res.More {
			break
		}
		f.After = p.Next
	}
	if o.DryRun {
		return res, nil
	}
	ctx = audit.WithFilter(ctx, f.describe())
	// Under the saga's row lock, the whole filter again, then the request's own check.
	checkAll := func(in *instance) error {
		if why := f.mismatch(in); why != "" {
			return refused(ErrNoLongerMatches, in.ID, "%s", why)
		}
		return check(in)
	}
	for _, id := range res.Matched {
		err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error { return a.request(ctx, tx, id, action, checkAll) })
		switch {
		case err == nil:
			res.Requested = append(res.Requested, id)
		case errors.Is(err, ErrWrongState), errors.Is(err, ErrNotFound):
			res.Refused = append(res.Refused, BulkRefusal{ID: id, Err: err})
		default:
			// The database failed: stop, and report what was filed so far (each of those
			// committed on its own).
			return res, err
		}
	}
	return res, nil
}

// Barrier is a participant's barrier row for a step of a saga: the record, in the
// participant consumer's processed_event, that the step's action or compensation was
// decided there (see the barrier in docs/sagas.md).
type Barrier struct {
	Consumer string
	Step     string
	Phase    outbox.SagaPhase
	At       time.Time
	// Result is set when the action's row holds its result: the action ran and took effect.
	// An action row without one was written by the compensation that came first (a null
	// compensation: the action never ran, and a late one is skipped) — or by an action
	// under an onceflow older than migration 0009, which kept no results.
	Result bool
}

// maxBarrierConsumers bounds the consumers Barriers visits, so a schema with very many
// inbox consumers cannot make a saga's page slow.
const maxBarrierConsumers = 200

// Barriers returns the barrier rows of the saga's steps in every consumer of the schema's
// processed_event. It reads the table by its primary key only: the distinct consumers by a
// loose index scan (one index descent each, at most maxBarrierConsumers), then each
// consumer's rows of exactly this saga's keys; its cost does not grow with the table.
func (a *Admin) Barriers(ctx context.Context, db DB, d *Detail) ([]Barrier, error) {
	type key struct {
		step  string
		phase outbox.SagaPhase
	}
	keys := map[string]key{}
	var list []string
	for _, s := range d.Steps {
		for _, ph := range []outbox.SagaPhase{outbox.SagaPhaseAction, outbox.SagaPhaseCompensation} {
			k := barrierKey(d.ID, s.wireName(), ph) // the name the participant knows the step by
			keys[k] = key{s.Name, ph}
			list = append(list, k)
		}
	}
	pe := pgsql.Table(a.st.schema, "processed_event")
	rows, err := db.Query(ctx, `WITH RECURSIVE c (consumer, n) AS (
			(SELECT consumer, 1 FROM `+pe+` ORDER BY consumer LIMIT 1)
			UNION ALL
			SELECT (SELECT p.consumer FROM `+pe+` p WHERE p.consumer > c.consumer ORDER BY p.consumer LIMIT 1), c.n + 1
			FROM c WHERE c.consumer IS NOT NULL AND c.n < $2)
		SELECT p.consumer, p.dedup_key, p.processed_at, p.result IS NOT NULL
		FROM c JOIN `+pe+` p ON p.consumer = c.consumer AND p.dedup_key = ANY($1::text[])
		ORDER BY p.processed_at, p.consumer`, list, maxBarrierConsumers)
	if err != nil {
		return nil, fmt.Errorf("saga: barrier rows of %q: %w", d.ID, a.st.explain(err))
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Barrier, error) {
		var b Barrier
		var k string
		err := r.Scan(&b.Consumer, &k, &b.At, &b.Result)
		b.Step, b.Phase = keys[k].step, keys[k].phase
		return b, err
	})
	if err != nil {
		return nil, fmt.Errorf("saga: barrier rows of %q: %w", d.ID, a.st.explain(err))
	}
	return out, nil
}
