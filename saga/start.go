package saga

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/sqltx"
	"github.com/onceflow/onceflow/internal/tracing"
	"github.com/onceflow/onceflow/outbox"
)

// StartOption configures StartTx.
type StartOption func(*startOptions)

type startOptions struct {
	id      string
	writer  *outbox.Writer
	metrics Metrics
	local   bool
}

// RunLocalSteps runs a saga's first steps that are local (Step.Local) in StartTx's
// transaction, with the start: the caller's business writes, the saga row and those steps'
// writes commit together (an order is placed and confirmed atomically), until a remote step's
// command is written or the saga ends (its OnCompleted or OnCompensated hook runs then too).
// A local step that fails there behaves as in any transition: saga.Fail compensates, another
// error rolls back its writes (a savepoint) and it runs again after its backoff.
//
// Without it (and always with StartSQLTx, whose *sql.Tx a local step cannot use), a local
// first step runs in a transition of its own after the start commits: a timer due at once,
// which the orchestrator's Run fires within about TimerInterval (DefaultTimerInterval,
// 200 ms). Sagas whose first step is remote are unaffected.
func RunLocalSteps() StartOption { return func(o *startOptions) { o.local = true } }

// WithID starts the saga under a caller-chosen id, such as the order id, which makes the start
// idempotent: starting the same id again is a no-op that returns the id. Default: a new
// UUIDv7. At most 200 bytes of UTF-8 text.
func WithID(id string) StartOption { return func(o *startOptions) { o.id = id } }

// WithWriter writes the saga's first command with w, and the saga row into w's schema.
// Default: the outbox package's default writer (schema "onceflow"). Use the same schema as
// the orchestrator (OrchestratorConfig.Schema).
func WithWriter(w *outbox.Writer) StartOption { return func(o *startOptions) { o.writer = w } }

// WithMetrics counts the start (Metrics.Started); pass the orchestrator's
// (Orchestrator.Metrics) to see starts beside completions. Default: not counted.
func WithMetrics(m Metrics) StartOption { return func(o *startOptions) { o.metrics = m } }

// ErrIDInUse is returned by StartTx when the id given with WithID belongs to a saga of another
// definition.
var ErrIDInUse = errors.New("saga: the id is in use by a saga of another definition")

// StartTx starts a saga of def with data inside the caller's transaction: the saga row, its
// first command (through the outbox) and its timers commit with the business writes, or not at
// all. It returns the saga id. With WithID, a second start of the same id (a retried request)
// writes nothing and returns the id; ErrIDInUse when that id runs another definition.
//
// Timer deadlines set here (the first step's timeout, the saga deadline) are computed on the
// application's clock; every later one on the database's.
func StartTx[D any](ctx context.Context, tx pgx.Tx, def *Definition[D], data D, opts ...StartOption) (string, error) {
	return start(ctx, pgxStarter{tx}, def, data, opts)
}

// StartSQLTx is StartTx for code written against database/sql: it starts a saga inside tx, a
// *sql.Tx of any PostgreSQL driver (pgx's stdlib, lib/pq), with the same statements and the
// same guarantees: the saga row, its timers and its first command commit with tx or not at
// all, and WithID makes the start idempotent. The first command is written with
// outbox.Writer.WriteSQLTx.
func StartSQLTx[D any](ctx context.Context, tx *sql.Tx, def *Definition[D], data D, opts ...StartOption) (string, error) {
	return start(ctx, sqlStarter{sqltx.Std(tx), tx}, def, data, opts)
}

// starter is what a start does with the caller's transaction; pgxStarter and sqlStarter run
// the same statements (the store's) on a pgx.Tx and on a *sql.Tx.
type starter interface {
	// insert writes the new saga row; false when one with its id exists.
	insert(ctx context.Context, st store, in *instance) (bool, error)
	// existingName returns the definition name of the saga with id.
	existingName(ctx context.Context, st store, id string) (string, error)
	// save writes a new saga's timers and its first command.
	save(ctx context.Context, st store, w *outbox.Writer, in *instance, fx *effects, deadline *timer) error
}

type pgxStarter struct{ tx pgx.Tx }

func (s pgxStarter) insert(ctx context.Context, st store, in *instance) (bool, error) {
	return st.insertTx(ctx, s.tx, in)
}

func (s pgxStarter) existingName(ctx context.Context, st store, id string) (string, error) {
	existing, _, err := st.load(ctx, s.tx, id, false)
	if err != nil {
		return "", err
	}
	return existing.Name, nil
}

func (s pgxStarter) save(ctx context.Context, st store, w *outbox.Writer, in *instance, fx *effects, deadline *timer) error {
	return st.saveTimersAndCommands(ctx, s.tx, w, in, fx, deadline)
}

// sqlStarter runs the store's statements through database/sql. database/sql has no batches,
// so a new saga's timers (at most two: the first step's timeout and the deadline) are one
// statement each instead of one round trip together.
type sqlStarter struct {
	q  sqltx.Querier
	tx *sql.Tx
}

func (s sqlStarter) insert(ctx context.Context, st store, in *instance) (bool, error) {
	steps, err := json.Marshal(in.Steps)
	if err != nil {
		return false, err
	}
	trace := in.Trace
	if trace == nil {
		trace = map[string]string{}
	}
	n, err := s.q.Exec(ctx, st.insert, in.ID, in.Name, in.Version, string(in.State), in.Step, in.Attempt, in.Budget,
		in.Waiting, in.Data, json.RawMessage(steps), trace, in.wrote)
	if err != nil {
		return false, fmt.Errorf("saga: insert saga %q into %s.saga: %w", in.ID, st.schema, st.explain(err))
	}
	return n == 1, nil
}

func (s sqlStarter) existingName(ctx context.Context, st store, id string) (string, error) {
	// The store's select, read column by column: only the name (the second column) matters.
	rows, err := s.tx.QueryContext(ctx, st.selectOne, id)
	if err != nil {
		return "", fmt.Errorf("saga: load saga %q: %w", id, st.explain(err))
	}
	defer func() { _ = rows.Close() }() // closed below on success; this covers the error paths
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return "", fmt.Errorf("saga: load saga %q: %w", id, err)
		}
		return "", errNoSaga
	}
	cols, err := rows.Columns()
	if err != nil {
		return "", err
	}
	vals := make([]any, len(cols))
	ptrs := make([]any, len(cols))
	for i := range vals {
		ptrs[i] = &vals[i]
	}
	if err := rows.Scan(ptrs...); err != nil {
		return "", fmt.Errorf("saga: load saga %q: %w", id, err)
	}
	switch name := vals[1].(type) {
	case string:
		return name, rows.Close()
	case []byte:
		return string(name), rows.Close()
	default:
		return "", fmt.Errorf("saga: load saga %q: unexpected name column %T", id, vals[1])
	}
}

func (s sqlStarter) save(ctx context.Context, st store, w *outbox.Writer, in *instance, fx *effects, deadline *timer) error {
	var timers []*timer
	if fx.setStep != nil {
		timers = append(timers, fx.setStep)
	}
	if deadline != nil {
		timers = append(timers, deadline)
	}
	for _, t := range timers {
		if _, err := s.q.Exec(ctx, st.setTimer, in.ID, t.Kind, t.Step, string(t.Phase), t.Attempt, t.Action, t.Due); err != nil {
			return fmt.Errorf("saga: store saga %q: %w", in.ID, st.explain(err))
		}
	}
	if len(fx.commands) > 0 {
		if err := w.WriteSQLTx(ctx, s.tx, "", fx.commands...); err != nil {
			return fmt.Errorf("saga: write the commands of saga %q: %w", in.ID, err)
		}
	}
	return nil
}

func start[D any](ctx context.Context, tx starter, def *Definition[D], data D, opts []StartOption) (string, error) {
	if def == nil {
		return "", errors.New("saga: StartTx with a nil definition")
	}
	o := startOptions{}
	for _, opt := range opts {
		opt(&o)
	}
	if o.id == "" {
		o.id = outbox.NewUUID()
	} else if err := checkName("saga id", o.id); err != nil {
		return "", fmt.Errorf("saga: %w", err)
	}
	w := o.writer
	if w == nil {
		w = defaultWriter
	}
	st := newStore(w.Config().Schema)
	raw, err := def.encodeData(data)
	if err != nil {
		return "", err
	}
	now := time.Now()
	// The caller's span context, so transitions no message carries (timers) join its trace.
	wc := w.Config()
	in := &instance{ID: o.id, Name: def.Name(), Version: def.Version(), State: StateRunning, Attempt: 1,
		Waiting: waitReply, Data: raw, Steps: make([]StepHistory, len(def.steps)),
		Trace: tracing.New(wc.TracerProvider, wc.Propagator).Inject(ctx, nil)}
	for i, s := range def.steps {
		in.Steps[i] = StepHistory{Name: s.name, Status: stepPending, Local: s.local != nil,
			LocalCompensation: s.compLocal != nil, Pivot: i == def.pivotIndex()}
	}
	m := &machine{def: def, now: now, in: in}
	pgxTx, canRun := tx.(pgxStarter)
	if def.steps[0].local != nil && (!o.local || !canRun) {
		// The local first step runs after the start commits, when Run fires this timer.
		in.Waiting = waitRun
		m.fx.setStep = &timer{Kind: timerStep, Step: 0, Phase: outbox.SagaPhaseAction, Attempt: 1, Action: actRun, Due: now}
	} else if err := m.send(0, outbox.SagaPhaseAction, 1); err != nil {
		return "", err
	}
	if in.State != StateRunning {
		// The first command could not be built: refuse to start rather than store a saga that
		// failed before it began.
		return "", fmt.Errorf("saga %q: %s", def.Name(), in.Steps[0].LastError)
	}
	inserted, err := tx.insert(ctx, st, in)
	if err != nil {
		return "", err
	}
	if !inserted {
		name, err := tx.existingName(ctx, st, o.id)
		if err != nil {
			return "", err
		}
		if name != def.Name() {
			return "", fmt.Errorf("%w: saga %q is a %q, not a %q", ErrIDInUse, o.id, name, def.Name())
		}
		return o.id, nil
	}
	if m.fx.local != nil {
		// RunLocalSteps: the row was inserted as the machine left it before the local run;
		// the runs change it (one more statement, for sagas that start with a local step).
		if err := runLocals(ctx, pgxTx.tx, m); err != nil {
			return "", err
		}
		b := &pgx.Batch{}
		if err := st.queueUpdate(b, in); err != nil {
			return "", err
		}
		var deadline *timer
		if in.State == StateRunning {
			deadline = deadlineTimer(def, now)
		}
		m.fx.cancelStep, m.fx.cancelAll = false, false // a new saga has no timers to cancel
		if err := st.send(ctx, pgxTx.tx, b, w, in, &m.fx, deadline); err != nil {
			return "", err
		}
	} else {
		m.fx.cancelStep = false // nothing to cancel on a new saga
		if err := tx.save(ctx, st, w, in, &m.fx, deadlineTimer(def, now)); err != nil {
			return "", err
		}
	}
	if o.metrics != nil {
		o.metrics.Started(def.Name())
		observeLocal(o.metrics, in, &m.fx)
		switch m.fx.finished {
		case StateCompleted:
			o.metrics.Completed(def.Name(), 0)
		case StateCompensated:
			o.metrics.Compensated(def.Name(), 0)
		}
	}
	return o.id, nil
}

var defaultWriter, _ = outbox.NewWriter(outbox.Config{})
