package saga

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
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
}

// Timer is a pending timer of a saga.
type Timer struct {
	Kind   string // step, deadline or operator
	Action string // timeout, resend, deadline, retry or compensate
	Step   string
	Due    time.Time
}

// ListFilter selects sagas; zero fields match everything.
type ListFilter struct {
	State State
	Name  string
	Limit int // default 100
}

// List returns sagas matching f, newest first.
func (a *Admin) List(ctx context.Context, db DB, f ListFilter) ([]Summary, error) {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	var conds []string
	args := []any{f.Limit}
	if f.State != "" {
		args = append(args, string(f.State))
		conds = append(conds, fmt.Sprintf("state = $%d", len(args)))
	}
	if f.Name != "" {
		args = append(args, f.Name)
		conds = append(conds, fmt.Sprintf("name = $%d", len(args)))
	}
	where := ""
	if len(conds) > 0 {
		where = " WHERE " + strings.Join(conds, " AND ")
	}
	rows, err := db.Query(ctx, `SELECT id, name, version, state, step, attempt, error, steps, created_at, updated_at FROM `+
		pgsql.Table(a.st.schema, "saga")+where+` ORDER BY created_at DESC, id LIMIT $1`, args...)
	if err != nil {
		return nil, fmt.Errorf("saga: list: %w", a.st.explain(err))
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Summary, error) {
		var s Summary
		var step int
		var steps []byte
		if err := r.Scan(&s.ID, &s.Name, &s.Version, &s.State, &step, &s.Attempt, &s.Error, &steps, &s.CreatedAt, &s.UpdatedAt); err != nil {
			return s, err
		}
		s.Step = stepName(steps, step)
		return s, nil
	})
	if err != nil {
		return nil, fmt.Errorf("saga: list: %w", a.st.explain(err))
	}
	return out, nil
}

func stepName(stepsJSON []byte, i int) string {
	var steps []StepHistory
	if json.Unmarshal(stepsJSON, &steps) != nil || i < 0 || i >= len(steps) {
		return fmt.Sprintf("#%d", i)
	}
	return steps[i].Name
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
	d := &Detail{Summary: summaryOf(in), Data: in.Data, Steps: in.Steps, CheckedAt: now}
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

// RetryTx asks the orchestrator to resume a stuck saga the way it was going, with a fresh
// attempt budget: a saga stuck while compensating (its compensation ran out of attempts) gets
// that compensation re-sent; a saga stuck moving forward (a reply that could not be applied,
// a timer that failed) gets its current step's command re-sent as a new attempt — a
// participant answers a later attempt of an action that already took effect with the result
// it kept, without running it again. Get's Wait.Phase says which. Fix the cause first (the
// error is in Get's Error and the step's LastError).
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
