package saga

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgsql"
)

// The reads below feed health checks (`onceflow status`, the console's overview). Each costs
// the same with a million sagas: they walk an index over the unfinished states or the due
// times and stop at a cap, because retention keeps finished sagas by the million.

// StateCount counts the unfinished sagas of one definition in one state.
type StateCount struct {
	Name  string
	State State
	Count int64
	// Oldest is when the oldest of them started.
	Oldest time.Time
}

// Unfinished counts the sagas running, compensating or stuck, per definition name and state,
// with the start of the oldest of each; finished sagas are not counted. It is an index-only
// scan of saga_state_created_idx ("state NOT IN (finished)" read every finished saga: 1.5 s
// at 1M).
func (a *Admin) Unfinished(ctx context.Context, db DB) ([]StateCount, error) {
	rows, err := db.Query(ctx, `SELECT name, state, count(*), min(created_at) FROM `+a.table("saga")+`
		WHERE state IN ('running', 'compensating', 'stuck') GROUP BY name, state ORDER BY name, state`)
	if err != nil {
		return nil, fmt.Errorf("saga: count unfinished sagas: %w", a.st.explain(err))
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[StateCount])
	if err != nil {
		return nil, fmt.Errorf("saga: count unfinished sagas: %w", a.st.explain(err))
	}
	return out, nil
}

// LongRunning is what LongRunning found: sagas running or compensating for longer than an age.
type LongRunning struct {
	// Count is how many, counted up to the cap LongRunning was given (Capped then).
	Count  int64
	Capped bool
	// Oldest is the one that started first; nil when Count is 0 (or it finished meanwhile).
	Oldest *Summary
	// CheckedAt is the database's clock at the count: ages are measured against it.
	CheckedAt time.Time
}

// LongRunning counts the sagas running or compensating for longer than age (by the database's
// clock), up to max, and returns the oldest of them. Stuck sagas are not counted: they wait
// for an operator, not for time.
func (a *Admin) LongRunning(ctx context.Context, db DB, age time.Duration, max int) (LongRunning, error) {
	var r LongRunning
	if max < 1 {
		return r, fmt.Errorf("%w: a long-running count needs a cap of at least 1, got %d", ErrBadFilter, max)
	}
	over := `FROM ` + a.table("saga") + ` WHERE state IN ('running', 'compensating') AND created_at < now() - make_interval(secs => $1)`
	if err := db.QueryRow(ctx, `SELECT count(*), now() FROM (SELECT 1 `+over+` LIMIT $2) s`, age.Seconds(), max).Scan(&r.Count, &r.CheckedAt); err != nil {
		return r, fmt.Errorf("saga: count long-running sagas: %w", a.st.explain(err))
	}
	r.Capped = r.Count >= int64(max)
	if r.Count == 0 {
		return r, nil
	}
	var o Summary
	err := db.QueryRow(ctx, `SELECT id, name, state, created_at `+over+` ORDER BY created_at LIMIT 1`, age.Seconds()).
		Scan(&o.ID, &o.Name, &o.State, &o.CreatedAt)
	switch {
	case err == nil:
		r.Oldest = &o
	case !errors.Is(err, pgx.ErrNoRows): // none when it finished in between
		return r, fmt.Errorf("saga: find the oldest long-running saga: %w", a.st.explain(err))
	}
	return r, nil
}

// OverdueTimer is a saga timer or operator request that was due and is not fired yet.
type OverdueTimer struct {
	SagaID string
	Name   string // the saga's definition; "" when the saga is gone
	Kind   string // step, deadline or operator
	Action string // timeout, resend, run, deadline, retry, compensate or upgrade
	Due    time.Time
}

// Overdue is what OverdueTimers found.
type Overdue struct {
	// Count is how many timers were due before the time given, up to the cap (Capped then).
	Count  int64
	Capped bool
	// Oldest is the most overdue; nil when Count is 0 (or it fired meanwhile).
	Oldest *OverdueTimer
	// CheckedAt is the database's clock at the count: how overdue is measured against it.
	CheckedAt time.Time
}

// OverdueTimers counts the saga timers (step timeouts, re-sends, deadlines) and operator
// requests due longer than lag ago (by the database's clock), up to max, and returns the most overdue: timers an
// orchestrator should have fired, so none runs for the schema or it cannot keep up. It walks
// saga_timer_due_at_idx: cheap with any number of timers.
func (a *Admin) OverdueTimers(ctx context.Context, db DB, lag time.Duration, max int) (Overdue, error) {
	var r Overdue
	if max < 1 {
		return r, fmt.Errorf("%w: an overdue-timer count needs a cap of at least 1, got %d", ErrBadFilter, max)
	}
	due := `t.due_at < now() - make_interval(secs => $1)`
	if err := db.QueryRow(ctx, `SELECT count(*), now() FROM (SELECT 1 FROM `+a.table("saga_timer")+` t WHERE `+due+` LIMIT $2) s`, lag.Seconds(), max).
		Scan(&r.Count, &r.CheckedAt); err != nil {
		return r, fmt.Errorf("saga: count overdue timers: %w", a.st.explain(err))
	}
	r.Capped = r.Count >= int64(max)
	if r.Count == 0 {
		return r, nil
	}
	var o OverdueTimer
	err := db.QueryRow(ctx, `SELECT t.saga_id, coalesce(s.name, ''), t.kind, t.action, t.due_at `+
		`FROM `+a.table("saga_timer")+` t LEFT JOIN `+a.table("saga")+` s ON s.id = t.saga_id
		WHERE `+due+` ORDER BY t.due_at LIMIT 1`, lag.Seconds()).Scan(&o.SagaID, &o.Name, &o.Kind, &o.Action, &o.Due)
	switch {
	case err == nil:
		r.Oldest = &o
	case !errors.Is(err, pgx.ErrNoRows): // fired in between
		return r, fmt.Errorf("saga: find the most overdue timer: %w", a.st.explain(err))
	}
	return r, nil
}

// Expired counts the sagas the Cleaner would delete now with this window (finished longer
// than window ago), up to max: the retention backlog, on the finished_at index.
func (a *Admin) Expired(ctx context.Context, db DB, window time.Duration, max int64) (int64, error) {
	if max < 1 {
		return 0, fmt.Errorf("%w: an expired count needs a cap of at least 1, got %d", ErrBadFilter, max)
	}
	var n int64
	if err := db.QueryRow(ctx, `SELECT count(*) FROM (SELECT 1 FROM `+a.table("saga")+`
		WHERE finished_at < now() - make_interval(secs => $1) LIMIT $2) s`, window.Seconds(), max).Scan(&n); err != nil {
		return 0, fmt.Errorf("saga: count expired sagas: %w", a.st.explain(err))
	}
	return n, nil
}

// table is the quoted name of one of the saga tables.
func (a *Admin) table(name string) string { return pgsql.Table(a.st.schema, name) }
