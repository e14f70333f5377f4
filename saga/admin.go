package saga

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgsql"
)

// DB runs the admin queries: a *pgxpool.Pool, *pgx.Conn or pgx.Tx.
type DB interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Admin reads sagas and files operator requests, for `onceflow saga` and health pages. It
// needs no definition: requests (RetryTx, CompensateTx) are carried out by an orchestrator
// that has the saga's definition, through the timer table, within its TimerInterval.
type Admin struct {
	st store
}

// NewAdmin returns an Admin for the saga tables of schema ("" = "onceflow").
func NewAdmin(schema string) (*Admin, error) {
	if schema == "" {
		schema = pgsql.DefaultSchema
	}
	if err := pgsql.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("saga: %w", err)
	}
	return &Admin{st: newStore(schema)}, nil
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
	var conds []string
	args := []any{f.Limit + 1}
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
	if f.Step != "" {
		conds = append(conds, "steps -> step ->> 'name' = "+arg(f.Step))
	}
	if f.Error != "" {
		conds = append(conds, "strpos(lower(error), lower("+arg(f.Error)+")) > 0")
	}
	if f.IDPrefix != "" {
		conds = append(conds, "starts_with(id, "+arg(f.IDPrefix)+")")
	}
	if !f.StartedBefore.IsZero() {
		conds = append(conds, "created_at < "+arg(f.StartedBefore))
	}
	if after != nil {
		conds = append(conds, "(created_at, id) < ("+arg(after.at)+", "+arg(after.id)+")")
	}
	where := ""
	if len(conds) > 0 {
		where = " WHERE " + strings.Join(conds, " AND ")
	}
	rows, err := db.Query(ctx, `SELECT id, name, version, state, step, attempt, error, steps -> step ->> 'name', created_at, updated_at FROM `+
		pgsql.Table(a.st.schema, "saga")+where+` ORDER BY created_at DESC, id DESC LIMIT $1`, args...)
	if err != nil {
		return Page{}, fmt.Errorf("saga: list: %w", a.st.explain(err))
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Summary, error) {
		var s Summary
		var step int
		var name *string
		if err := r.Scan(&s.ID, &s.Name, &s.Version, &s.State, &step, &s.Attempt, &s.Error, &name, &s.CreatedAt, &s.UpdatedAt); err != nil {
			return s, err
		}
		s.Step = fmt.Sprintf("#%d", step)
		if name != nil {
			s.Step = *name
		}
		return s, nil
	})
	if err != nil {
		return Page{}, fmt.Errorf("saga: list: %w", a.st.explain(err))
	}
	p := Page{Sagas: out}
	if len(out) > f.Limit {
		p.Sagas = out[:f.Limit]
		last := p.Sagas[f.Limit-1]
		p.Next = cursor{at: last.CreatedAt, id: last.ID}.String()
	}
	return p, nil
}

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

// ErrNotFound is returned for a saga id without a row (never started, or removed by the
// retention cleanup after it finished).
var ErrNotFound = errors.New("saga: no saga with this id")

// Get returns one saga with its history, its timers and what it waits for (Detail.Wait).
// For a saga waiting for a reply it looks the current command up by event id in the outbox,
// which has no index on it (a second b-tree would cost every business commit): at a large
// backlog that is one scan of the outbox, as `onceflow outbox find` does.
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
	if d.Wait, err = a.wait(ctx, db, in, d.Timers); err != nil {
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

// RetryTx asks the orchestrator to resume a stuck saga: it re-sends the compensation that ran
// out of attempts, with a fresh attempt budget. Fix the cause first (the error is in Get's
// Error and the step's LastError).
func (a *Admin) RetryTx(ctx context.Context, tx pgx.Tx, id string) error {
	return a.request(ctx, tx, id, actRetry, func(in *instance) error {
		if in.State != StateStuck {
			return fmt.Errorf("%w: saga %q is %s; only a stuck saga can be retried", ErrWrongState, id, in.State)
		}
		return nil
	})
}

// CompensateTx asks the orchestrator to stop a running saga and compensate the steps that took
// effect (including the current one: the barrier makes that a no-op if its action never ran).
// A saga past its pivot cannot be compensated.
func (a *Admin) CompensateTx(ctx context.Context, tx pgx.Tx, id string) error {
	return a.request(ctx, tx, id, actCompensate, func(in *instance) error {
		if in.State != StateRunning {
			return fmt.Errorf("%w: saga %q is %s; only a running saga can be compensated", ErrWrongState, id, in.State)
		}
		return nil
	})
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
	return nil
}
