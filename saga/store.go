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
	insert, lock, lockMany, update, setTimer  string
	delTimer, stuck, tookEffect               string
	delTimers, claimTimers, selectOne, insOpr string
	findCommand                               string    // wait.go
	park                                      parkedSQL // parked.go
}

func newStore(schema string) store {
	sagaT, timerT := pgsql.Table(schema, "saga"), pgsql.Table(schema, "saga_timer")
	cols := `id, name, version, state, step, attempt, budget, waiting, data, steps, error, created_at, updated_at, trace`
	return store{
		schema:      schema,
		park:        newParkedSQL(schema),
		findCommand: findCommandSQL(schema),
		// command_event and command_tx: the event id of the last command the saga wrote, and
		// the transaction that wrote it, which is this one (the outbox row's tx is the same
		// pg_current_xact_id()): the saga's page finds the command by outbox_tx_idx (wait.go).
		// $12 is '' when this transaction wrote no command of the saga: the record stays.
		insert: `INSERT INTO ` + sagaT + ` (id, name, version, state, step, attempt, budget, waiting, data, steps, trace, command_event, command_tx)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, NULLIF($12::text, '')::uuid, CASE WHEN $12::text <> '' THEN pg_current_xact_id() END)
			ON CONFLICT (id) DO NOTHING`,
		selectOne: `SELECT ` + cols + `, now() FROM ` + sagaT + ` WHERE id = $1`,
		// now() comes along: transitions compute timer deadlines on the database clock, the
		// one the timer claim compares them with.
		lock: `SELECT ` + cols + `, now() FROM ` + sagaT + ` WHERE id = $1 FOR UPDATE`,
		// Rows locked in id order, whoever locks them: two orchestrators applying replies of
		// the same sagas in batches wait for each other instead of deadlocking.
		lockMany: `SELECT ` + cols + `, now() FROM ` + sagaT + ` WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE`,
		// A saga whose message cannot be applied (SettlePoison): stuck with the error, its
		// step timer gone (it would only fire into the same failure).
		stuck: `WITH s AS (UPDATE ` + sagaT + ` SET state = 'stuck', error = $2, updated_at = now()
			WHERE id = $1 AND state IN ('running', 'compensating') RETURNING id, name)
			, t AS (DELETE FROM ` + timerT + ` WHERE saga_id IN (SELECT id FROM s) AND kind = 'step')
			SELECT name FROM s`,
		// A done reply of the current step's action that could not be applied (SettlePoison):
		// the step's later commands say that the action took effect (StepHistory.TookEffect).
		tookEffect: `UPDATE ` + sagaT + ` SET steps = jsonb_set(steps, ARRAY[step::text, 'took_effect'], 'true')
			WHERE id = $1 AND state IN ('running', 'compensating') AND steps -> step ->> 'name' = $2`,
		update: `UPDATE ` + sagaT + ` SET state = $2, step = $3, attempt = $4, budget = $5, waiting = $6, data = $7, steps = $8,
			error = $9, updated_at = now(), finished_at = CASE WHEN $2 IN ('completed', 'compensated') THEN now() END,
			command_event = coalesce(NULLIF($10::text, '')::uuid, command_event),
			command_tx = CASE WHEN $10::text <> '' THEN pg_current_xact_id() ELSE command_tx END
			WHERE id = $1`,
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
		// Only timers of sagas whose definition name and version ($2, $3: the orchestrator's
		// registered ones) the claiming orchestrator has: another one, that has the version,
		// fires the others (a rolling deploy). The due rows are walked on saga_timer_due_at_idx,
		// each joined to its saga by primary key.
		claimTimers: `SELECT t.saga_id, t.kind, t.step, t.phase, t.attempt, t.action, t.due_at FROM ` + timerT + ` t
			JOIN ` + sagaT + ` s ON s.id = t.saga_id
			WHERE t.due_at <= now() AND ((s.name, s.version) IN (SELECT r.name, r.version FROM unnest($2::text[], $3::int[]) AS r (name, version))
				-- an upgrade request is carried out by an orchestrator that has the target
				-- version (in attempt; 0: the newest that declares the upgrade, so any later
				-- one), which may lack the saga's own
				OR (t.kind = 'operator' AND t.action = 'upgrade' AND EXISTS (SELECT FROM unnest($2::text[], $3::int[]) AS r (name, version)
					WHERE r.name = s.name AND (r.version = t.attempt OR (t.attempt = 0 AND r.version > s.version)))))
			ORDER BY t.due_at LIMIT $1 FOR UPDATE OF t, s SKIP LOCKED`,
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
	tag, err := tx.Exec(ctx, st.insert, in.ID, in.Name, in.Version, in.State, in.Step, in.Attempt, in.Budget, in.Waiting, in.Data, steps, trace, in.wrote)
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

func (st store) scan(row pgx.Row, id string) (*instance, time.Time, error) {
	return st.scanRow(row, &id)
}

// scanRow reads a saga row; *id is set as soon as the row's id is known, so a caller reading
// many rows can tell which one failed.
func (st store) scanRow(row pgx.Row, id *string) (*instance, time.Time, error) {
	var in instance
	var steps []byte
	var now time.Time
	err := row.Scan(&in.ID, &in.Name, &in.Version, &in.State, &in.Step, &in.Attempt, &in.Budget,
		&in.Waiting, &in.Data, &steps, &in.Error, &in.CreatedAt, &in.UpdatedAt, &in.Trace, &now)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, now, errNoSaga
	}
	if err != nil {
		return nil, now, fmt.Errorf("saga: load saga %q: %w", *id, st.explain(err))
	}
	*id = in.ID
	if err := json.Unmarshal(steps, &in.Steps); err != nil {
		return nil, now, fmt.Errorf("saga: saga %q has a corrupt step history: %w", in.ID, err)
	}
	return &in, now, nil
}

// saveTx stores a transition's outcome in one round trip: the saga row, its timers and its
// outbox rows.
func (st store) saveTx(ctx context.Context, tx pgx.Tx, w *outbox.Writer, in *instance, fx *effects) error {
	b := &pgx.Batch{}
	if err := st.queueUpdate(b, in); err != nil {
		return err
	}
	return st.send(ctx, tx, b, w, in, fx, nil)
}

// queueUpdate queues the update of a saga's row to its state in memory.
func (st store) queueUpdate(b *pgx.Batch, in *instance) error {
	steps, err := json.Marshal(in.Steps)
	if err != nil {
		return err
	}
	b.Queue(st.update, in.ID, in.State, in.Step, in.Attempt, in.Budget, in.Waiting, in.Data, steps, in.Error, in.wrote)
	return nil
}

// saveTimersAndCommands stores what a new saga's first transition decided: its timers and
// its first command (the row itself was just inserted).
func (st store) saveTimersAndCommands(ctx context.Context, tx pgx.Tx, w *outbox.Writer, in *instance, fx *effects, deadline *timer) error {
	return st.send(ctx, tx, &pgx.Batch{}, w, in, fx, deadline)
}

// send adds a transition's timers and commands to b and sends it: one round trip.
func (st store) send(ctx context.Context, tx pgx.Tx, b *pgx.Batch, w *outbox.Writer, in *instance, fx *effects, deadline *timer) error {
	st.queueTimers(b, in.ID, fx, deadline)
	if len(fx.commands) > 0 {
		if err := w.QueueWriteTx(ctx, b, "", fx.commands...); err != nil {
			return fmt.Errorf("saga: write the commands of saga %q: %w", in.ID, st.explain(err))
		}
	}
	if b.Len() == 0 {
		return nil
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("saga: store saga %q: %w", in.ID, st.explain(err))
	}
	return nil
}

// queueTimers queues a transition's timer changes into b.
func (st store) queueTimers(b *pgx.Batch, id string, fx *effects, deadline *timer) {
	switch {
	case fx.cancelAll:
		if fx.hadStepTimer || fx.hadDeadline {
			b.Queue(st.delTimers, id)
		}
	case fx.setStep != nil:
		t := fx.setStep
		b.Queue(st.setTimer, id, t.Kind, t.Step, string(t.Phase), t.Attempt, t.Action, t.Due)
	case fx.cancelStep && fx.hadStepTimer:
		b.Queue(st.delTimer, id, timerStep)
	}
	if deadline != nil {
		b.Queue(st.setTimer, id, deadline.Kind, 0, "", 0, deadline.Action, deadline.Due)
	}
}

// locked is what queueLockMany read: the sagas by id, those whose row cannot be read (a
// corrupt step history: only their replies fail), and the database's clock; and which of
// them have parked replies.
type locked struct {
	sagas  map[string]*instance
	broken map[string]error
	now    time.Time
	// parked holds the sagas that have parked replies (parked.go).
	parked map[string]bool
}

// queueLockMany queues the locking read of the sagas with the given ids (sorted, distinct)
// into b: one statement, rows locked in id order. An id without a row is absent.
func (st store) queueLockMany(b *pgx.Batch, ids []string, out *locked) {
	b.Queue(st.lockMany, ids).Query(func(rows pgx.Rows) error {
		out.sagas, out.broken = make(map[string]*instance, len(ids)), map[string]error{}
		for rows.Next() {
			var id string
			in, now, err := st.scanRow(rows, &id)
			if err != nil {
				if id == "" {
					return err
				}
				out.broken[id] = err
				continue
			}
			out.sagas[in.ID], out.now = in, now
		}
		if err := rows.Err(); err != nil {
			return fmt.Errorf("saga: lock %d sagas: %w", len(ids), st.explain(err))
		}
		return nil
	})
}

// due is a claimed timer.
type due struct {
	sagaID string
	t      timer
}

// claimDueTx locks up to limit due timers (and their sagas) in tx, of sagas whose definition
// is one of the registered ones (versions).
func (st store) claimDueTx(ctx context.Context, tx pgx.Tx, limit int, v versions) ([]due, error) {
	rows, err := tx.Query(ctx, st.claimTimers, limit, v.names, v.versions)
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
