package saga

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/outbox"
)

// store holds the SQL of one schema's saga tables.
type store struct {
	schema                                    string
	insert, lock, update, setTimer, delTimer  string
	delTimers, claimTimers, selectOne, insOpr string
}

func newStore(schema string) store {
	sagaT, timerT := pgsql.Table(schema, "saga"), pgsql.Table(schema, "saga_timer")
	cols := `id, name, version, state, step, attempt, budget, waiting, data, steps, error, created_at, updated_at, trace`
	return store{
		schema: schema,
		insert: `INSERT INTO ` + sagaT + ` (id, name, version, state, step, attempt, budget, waiting, data, steps, trace)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT (id) DO NOTHING`,
		selectOne: `SELECT ` + cols + `, now() FROM ` + sagaT + ` WHERE id = $1`,
		// now() comes along: transitions compute timer deadlines on the database clock, the
		// one the timer claim compares them with.
		lock: `SELECT ` + cols + `, now() FROM ` + sagaT + ` WHERE id = $1 FOR UPDATE`,
		update: `UPDATE ` + sagaT + ` SET state = $2, step = $3, attempt = $4, budget = $5, waiting = $6, data = $7, steps = $8,
			error = $9, updated_at = now(), finished_at = CASE WHEN $2 IN ('completed', 'compensated') THEN now() END WHERE id = $1`,
		setTimer: `INSERT INTO ` + timerT + ` (saga_id, kind, step, phase, attempt, action, due_at) VALUES ($1, $2, $3, $4, $5, $6, $7)
			ON CONFLICT (saga_id, kind) DO UPDATE SET step = EXCLUDED.step, phase = EXCLUDED.phase, attempt = EXCLUDED.attempt,
			action = EXCLUDED.action, due_at = EXCLUDED.due_at`,
		insOpr: `INSERT INTO ` + timerT + ` (saga_id, kind, action, due_at) VALUES ($1, 'operator', $2, now())
			ON CONFLICT (saga_id, kind) DO UPDATE SET action = EXCLUDED.action, due_at = EXCLUDED.due_at`,
		delTimer:  `DELETE FROM ` + timerT + ` WHERE saga_id = $1 AND kind = $2`,
		delTimers: `DELETE FROM ` + timerT + ` WHERE saga_id = $1`,
		// Both rows locked, or the pair skipped: a transition in progress holds the saga row,
		// and the timer is looked at again on the next tick. Never waits, so it cannot
		// deadlock with a reply that locks the saga and then changes its timer.
		claimTimers: `SELECT t.saga_id, t.kind, t.step, t.phase, t.attempt, t.action, t.due_at FROM ` + timerT + ` t
			JOIN ` + sagaT + ` s ON s.id = t.saga_id
			WHERE t.due_at <= now() ORDER BY t.due_at LIMIT $1 FOR UPDATE OF t, s SKIP LOCKED`,
	}
}

// insertTx writes a new saga row; false when one with this id exists.
func (st store) insertTx(ctx context.Context, tx pgx.Tx, in *instance) (bool, error) {
	steps, err := json.Marshal(in.Steps)
	if err != nil {
		return false, err
	}
	trace := in.Trace
	if trace == nil {
		trace = map[string]string{}
	}
	tag, err := tx.Exec(ctx, st.insert, in.ID, in.Name, in.Version, in.State, in.Step, in.Attempt, in.Budget, in.Waiting, in.Data, steps, trace)
	if err != nil {
		return false, fmt.Errorf("saga: insert saga %q into %s.saga: %w", in.ID, st.schema, st.explain(err))
	}
	return tag.RowsAffected() == 1, nil
}

// errNoSaga is returned by load for an id without a row.
var errNoSaga = errors.New("saga: no such saga")

// load reads one saga, locking its row when lock is set, and the database's clock.
func (st store) load(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, id string, lock bool,
) (*instance, time.Time, error) {
	sql := st.selectOne
	if lock {
		sql = st.lock
	}
	return st.scan(q.QueryRow(ctx, sql, id), id)
}

// queueLock queues the locking read of a saga into b; after the batch ran, *in and *now hold
// it (or load's error is returned by the batch).
func (st store) queueLock(b *pgx.Batch, id string, in **instance, now *time.Time) {
	b.Queue(st.lock, id).QueryRow(func(row pgx.Row) error {
		var err error
		*in, *now, err = st.scan(row, id)
		return err
	})
}

func (st store) scan(row pgx.Row, id string) (*instance, time.Time, error) {
	var in instance
	var steps []byte
	var now time.Time
	err := row.Scan(&in.ID, &in.Name, &in.Version, &in.State, &in.Step, &in.Attempt, &in.Budget,
		&in.Waiting, &in.Data, &steps, &in.Error, &in.CreatedAt, &in.UpdatedAt, &in.Trace, &now)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, now, errNoSaga
	}
	if err != nil {
		return nil, now, fmt.Errorf("saga: load saga %q: %w", id, st.explain(err))
	}
	if err := json.Unmarshal(steps, &in.Steps); err != nil {
		return nil, now, fmt.Errorf("saga: saga %q has a corrupt step history: %w", id, err)
	}
	return &in, now, nil
}

// saveTx stores a transition's outcome: the saga row, its timers and its outbox rows.
func (st store) saveTx(ctx context.Context, tx pgx.Tx, w *outbox.Writer, in *instance, fx *effects) error {
	steps, err := json.Marshal(in.Steps)
	if err != nil {
		return err
	}
	b := &pgx.Batch{}
	b.Queue(st.update, in.ID, in.State, in.Step, in.Attempt, in.Budget, in.Waiting, in.Data, steps, in.Error)
	return st.send(ctx, tx, b, w, in, fx, nil)
}

// saveTimersAndCommands stores what a new saga's first transition decided: its timers and
// its first command (the row itself was just inserted).
func (st store) saveTimersAndCommands(ctx context.Context, tx pgx.Tx, w *outbox.Writer, in *instance, fx *effects, deadline *timer) error {
	return st.send(ctx, tx, &pgx.Batch{}, w, in, fx, deadline)
}

func (st store) send(ctx context.Context, tx pgx.Tx, b *pgx.Batch, w *outbox.Writer, in *instance, fx *effects, deadline *timer) error {
	switch {
	case fx.cancelAll:
		if fx.hadStepTimer || fx.hadDeadline {
			b.Queue(st.delTimers, in.ID)
		}
	case fx.setStep != nil:
		t := fx.setStep
		b.Queue(st.setTimer, in.ID, t.Kind, t.Step, string(t.Phase), t.Attempt, t.Action, t.Due)
	case fx.cancelStep && fx.hadStepTimer:
		b.Queue(st.delTimer, in.ID, timerStep)
	}
	if deadline != nil {
		b.Queue(st.setTimer, in.ID, deadline.Kind, 0, "", 0, deadline.Action, deadline.Due)
	}
	if b.Len() > 0 {
		// One round trip for the row and its timers.
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return fmt.Errorf("saga: store saga %q: %w", in.ID, st.explain(err))
		}
	}
	if len(fx.commands) > 0 {
		if err := w.WriteTx(ctx, tx, "", fx.commands...); err != nil {
			return fmt.Errorf("saga: write the commands of saga %q: %w", in.ID, st.explain(err))
		}
	}
	return nil
}

// due is a claimed timer.
type due struct {
	sagaID string
	t      timer
}

// claimDueTx locks up to limit due timers (and their sagas) in tx.
func (st store) claimDueTx(ctx context.Context, tx pgx.Tx, limit int) ([]due, error) {
	rows, err := tx.Query(ctx, st.claimTimers, limit)
	if err != nil {
		return nil, fmt.Errorf("saga: claim due timers: %w", st.explain(err))
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (due, error) {
		var d due
		var phase string
		err := r.Scan(&d.sagaID, &d.t.Kind, &d.t.Step, &phase, &d.t.Attempt, &d.t.Action, &d.t.Due)
		d.t.Phase = outbox.SagaPhase(phase)
		return d, err
	})
	if err != nil {
		return nil, fmt.Errorf("saga: claim due timers: %w", st.explain(err))
	}
	return out, nil
}

// explain wraps an error of a statement on the saga tables (schemaError).
func (st store) explain(err error) error { return schemaError(st.schema, err) }

// deadlineTimer is the saga-wide deadline's timer, or nil when the definition has none.
func deadlineTimer(def definition, now time.Time) *timer {
	if def.deadline() <= 0 {
		return nil
	}
	return &timer{Kind: timerDeadline, Action: actDeadline, Due: now.Add(def.deadline())}
}
