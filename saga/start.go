package saga

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/tracing"
	"github.com/onceflow/onceflow/outbox"
)

// StartOption configures StartTx.
type StartOption func(*startOptions)

type startOptions struct {
	id      string
	writer  *outbox.Writer
	metrics Metrics
}

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
		in.Steps[i] = StepHistory{Name: s.name, Status: stepPending}
	}
	m := &machine{def: def, now: now, in: in}
	if err := m.send(0, outbox.SagaPhaseAction, 1); err != nil {
		return "", err
	}
	if in.State != StateRunning {
		// The first command could not be built: refuse to start rather than store a saga that
		// failed before it began.
		return "", fmt.Errorf("saga %q: %s", def.Name(), in.Steps[0].LastError)
	}
	inserted, err := st.insertTx(ctx, tx, in)
	if err != nil {
		return "", err
	}
	if !inserted {
		existing, _, err := st.load(ctx, tx, o.id, false)
		if err != nil {
			return "", err
		}
		if existing.Name != def.Name() {
			return "", fmt.Errorf("%w: saga %q is a %q, not a %q", ErrIDInUse, o.id, existing.Name, def.Name())
		}
		return o.id, nil
	}
	m.fx.cancelStep = false // nothing to cancel on a new saga
	if err := st.saveTimersAndCommands(ctx, tx, w, in, &m.fx, deadlineTimer(def, now)); err != nil {
		return "", err
	}
	if o.metrics != nil {
		o.metrics.Started(def.Name())
	}
	return o.id, nil
}

var defaultWriter, _ = outbox.NewWriter(outbox.Config{})
