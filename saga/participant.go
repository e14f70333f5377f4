package saga

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/config"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/tracing"
	"github.com/onceflow/onceflow/outbox"
)

// Fail returns the error a participant's handler returns for a business failure: the step
// cannot succeed (stock short, payment declined), its writes are rolled back, and the
// orchestrator compensates the steps before it. reason reaches the saga's history.
func Fail(reason string) error {
	return &outcomeError{outcome: outbox.SagaOutcomeFailed, reason: reason}
}

// Retry returns the error a participant's handler returns for a transient failure that a
// later attempt may not have (a provider timing out): its writes are rolled back and the
// orchestrator re-sends the command after the step's backoff, as the next attempt, until the
// step's attempts are used up; then it compensates.
func Retry(err error) error {
	reason := "retry requested"
	if err != nil {
		reason = err.Error()
	}
	return &outcomeError{outcome: outbox.SagaOutcomeRetry, reason: reason, err: err}
}

// outcomeError is a handler's typed outcome. Any other error is tried again, then answered as
// a failed attempt (outcome retry) carrying it; see Action.
type outcomeError struct {
	outcome, reason string
	err             error
}

func (e *outcomeError) Error() string { return "saga: step " + e.outcome + ": " + e.reason }
func (e *outcomeError) Unwrap() error { return e.err }

// ParticipantConfig configures a Participant. Pool and Consumer are required.
type ParticipantConfig struct {
	// Pool opens one transaction per command. Required.
	Pool *pgxpool.Pool
	// Schema holds processed_event and the outbox the replies go through. Default "onceflow".
	Schema string
	// Consumer names this participant in its dedup and barrier rows, e.g. "inventory".
	// Required; keep it stable.
	Consumer string
	// Writer writes the replies; default outbox.NewWriter(outbox.Config{Schema: Schema}).
	Writer *outbox.Writer
	// Logger receives skipped commands (debug). Default slog.Default().
	Logger *slog.Logger
	// Metrics counts the barrier's decisions (Metrics.Barrier) and commands answered as
	// failed after their handler kept failing (Metrics.StepError). Default NopMetrics{}.
	Metrics Metrics
	// MaxAttempts is how often Action and Compensation run a command whose handler fails
	// with an ordinary error (neither Fail nor Retry) or panics, with a backoff from
	// DefaultRetryBackoff doubling, before answering it as a failed attempt carrying the
	// error. Default DefaultMaxAttempts. (The batched consumer has its own,
	// inboxkafka.BatchConfig.MaxAttempts.)
	MaxAttempts int
	// TracerProvider records a `process <command topic>` span per command, child of the
	// command's creation context, so the reply it writes continues the saga's trace. Default
	// nil: the global provider. Propagator: default nil, the global one or W3C trace
	// context. Both also go to the default Writer.
	TracerProvider trace.TracerProvider
	Propagator     propagation.TextMapPropagator
}

// Participant turns typed step handlers into idempotent Watermill handlers (Action,
// Compensation). Each command runs in one transaction holding its dedup row, the barrier's
// rows, the handler's writes and the reply (through the outbox), so a duplicated, late or
// reordered command acts at most once:
//
//   - the same command delivered again is skipped (dedup on saga id, step, phase, attempt);
//   - an action whose earlier attempt took effect is skipped: its reply is already on its way;
//   - a compensation whose action never ran is recorded and answered without running the
//     compensation handler (null compensation), and an action that arrives after its
//     compensation is skipped (no hanging effect) — DTM's barrier, on processed_event.
//
// Run its handlers without the inbox middleware: they deduplicate themselves.
type Participant struct {
	cfg ParticipantConfig
	ib  *inbox.Inbox
	tr  *tracing.Tracer // trace.go
	// keepResultSQL stores actions' results with their barrier rows; resultSQL reads them.
	keepResultSQL, resultSQL string
}

// NewParticipant validates cfg, reporting every problem at once (*ConfigError).
func NewParticipant(cfg ParticipantConfig) (*Participant, error) {
	if cfg.Schema == "" {
		cfg.Schema = pgsql.DefaultSchema
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NopMetrics{}
	}
	if cfg.MaxAttempts == 0 {
		cfg.MaxAttempts = DefaultMaxAttempts
	}
	var problems []error
	if cfg.MaxAttempts < 1 {
		problems = append(problems, fmt.Errorf("MaxAttempts is %d; use 0 for the default (%d) or a positive number", cfg.MaxAttempts, DefaultMaxAttempts))
	}
	if cfg.Writer == nil {
		w, err := outbox.NewWriter(outbox.Config{Schema: cfg.Schema, TracerProvider: cfg.TracerProvider, Propagator: cfg.Propagator})
		if err != nil {
			problems = append(problems, err)
		}
		cfg.Writer = w
	}
	ib, err := inbox.New(inbox.Config{Pool: cfg.Pool, Schema: cfg.Schema, Consumer: cfg.Consumer, Writer: cfg.Writer, Logger: cfg.Logger})
	var ce *ConfigError
	if errors.As(err, &ce) {
		problems = append(problems, ce.Problems...)
	} else if err != nil {
		problems = append(problems, err)
	}
	if err := config.Check("saga participant", problems...); err != nil {
		return nil, err
	}
	pe := pgsql.Table(cfg.Schema, "processed_event")
	return &Participant{cfg: cfg, ib: ib, tr: tracing.New(cfg.TracerProvider, cfg.Propagator),
		// One statement per action, pipelined: an UPDATE … FROM unnest(…) is planned for 100
		// rows and may scan the whole table instead of using the primary key.
		keepResultSQL: `UPDATE ` + pe + ` SET result = $3 WHERE consumer = $1 AND dedup_key = $2`,
		resultSQL:     `SELECT dedup_key, result FROM ` + pe + ` WHERE consumer = $1 AND dedup_key = ANY($2::text[])`,
	}, nil
}

// Action returns the Watermill handler of a step's command: it decodes the command (JSON) into
// C, runs h in the command's transaction and replies with h's result R (JSON). h returns
// Fail(reason) for a business failure, Retry(err) for a transient one. Any other error (or a
// panic) rolls the attempt back and runs it again, up to ParticipantConfig.MaxAttempts times
// with backoff; then the command is answered as a failed attempt carrying the error, so its
// partition moves on and the saga retries or compensates. h must not commit or roll back tx
// (the participant does; tx.Begin savepoints are fine). For inboxkafka.BatchConsumer, use
// ActionProcessor.
func Action[C, R any](p *Participant, h func(ctx context.Context, tx pgx.Tx, cmd C) (R, error)) message.NoPublishHandlerFunc {
	run := actionRun(h)
	return func(msg *message.Message) error { return p.handle(msg, outbox.SagaPhaseAction, run) }
}

// Compensation returns the Watermill handler of a step's compensation command, like Action.
// h must undo the action's effect; it runs only if the action took effect (the barrier
// answers a compensation of an action that never ran without calling h). Fail and Retry both
// ask the orchestrator to re-send it; after the saga's compensation attempts it is stuck.
func Compensation[C any](p *Participant, h func(ctx context.Context, tx pgx.Tx, cmd C) error) message.NoPublishHandlerFunc {
	run := compensationRun(h)
	return func(msg *message.Message) error { return p.handle(msg, outbox.SagaPhaseCompensation, run) }
}

func actionRun[C, R any](h func(ctx context.Context, tx pgx.Tx, cmd C) (R, error)) stepRun {
	return func(ctx context.Context, tx pgx.Tx, msg *message.Message, _ []byte) ([]byte, error) {
		var cmd C
		if err := json.Unmarshal(msg.Payload, &cmd); err != nil {
			return nil, Fail(fmt.Sprintf("cannot decode the command as %T: %v", cmd, err))
		}
		res, err := h(ctx, tx, cmd)
		if err != nil {
			return nil, err
		}
		return json.Marshal(res)
	}
}

func compensationRun[C any](h func(ctx context.Context, tx pgx.Tx, cmd C) error) stepRun {
	return compensationForRun(func(ctx context.Context, tx pgx.Tx, cmd C, _ *json.RawMessage) error { return h(ctx, tx, cmd) })
}

func compensationForRun[C, R any](h func(ctx context.Context, tx pgx.Tx, cmd C, done *R) error) stepRun {
	return func(ctx context.Context, tx pgx.Tx, msg *message.Message, actionResult []byte) ([]byte, error) {
		var cmd C
		if err := json.Unmarshal(msg.Payload, &cmd); err != nil {
			return nil, Fail(fmt.Sprintf("cannot decode the compensation as %T: %v", cmd, err))
		}
		var done *R
		if actionResult != nil {
			done = new(R)
			if err := json.Unmarshal(actionResult, done); err != nil {
				return nil, Fail(fmt.Sprintf("cannot decode the action's result as %T: %v", *done, err))
			}
		}
		return []byte("{}"), h(ctx, tx, cmd, done)
	}
}

// CompensationFor is Compensation for a handler that undoes what its action did from the
// action's own result: h gets the compensation command and done, the result R the action's
// handler returned (kept with the action's barrier row, in its transaction). Use it whenever
// the compensation needs something only the action knows (a reservation id, a payment id):
// when an action commits but its reply reaches the saga too late (the step timed out first,
// so the step is compensated as uncertain), OnReply never stored it in the saga's data, and a
// command built from that data cannot say what to undo — done can. done is nil only when the
// action's result was not kept: it ran under an onceflow older than migration 0009, or its
// barrier row expired with the retention window.
func CompensationFor[C, R any](p *Participant, h func(ctx context.Context, tx pgx.Tx, cmd C, done *R) error) message.NoPublishHandlerFunc {
	run := compensationForRun(h)
	return func(msg *message.Message) error { return p.handle(msg, outbox.SagaPhaseCompensation, run) }
}

// barrierKey is the participant's record that a step's action (or compensation) took effect.
// It has no attempt: it says whether any attempt did.
func barrierKey(sagaID, step string, phase outbox.SagaPhase) string {
	return "saga-barrier:" + strconv.Quote(sagaID) + ":" + strconv.Quote(step) + ":" + string(phase)
}

// errTxManaged is what Commit and Rollback return on a handler's transaction.
var errTxManaged = fmt.Errorf("%w (saga participant: it commits after writing the reply; to abort, return an error)", outbox.ErrTxManaged)

// handle runs one command, trying it again while its handler fails with an ordinary error,
// then answering it as a failed attempt (see Action). Other errors (the database unreachable)
// are returned, so the router redelivers the command.
func (p *Participant) handle(msg *message.Message, phase outbox.SagaPhase, run stepRun) error {
	ref, replyTo, key, err := p.readCommand(msg, phase)
	if err != nil {
		// Poison: no retry can fix it; inbox.IsPoison is true so a poison queue takes it.
		return err
	}
	for tries := 1; ; tries++ {
		err := p.handleOnce(msg, phase, ref, replyTo, key, run)
		var he *handlerError
		if !errors.As(err, &he) {
			return err
		}
		if tries >= p.cfg.MaxAttempts {
			return p.settle(msg.Context(), msg, phase, inbox.Poison{Attempts: tries, Err: he.err})
		}
		p.cfg.Logger.Warn("saga participant: the handler failed; trying the command again", "consumer", p.cfg.Consumer,
			"saga_id", ref.ID, "step", ref.Step, "try", tries, "max_attempts", p.cfg.MaxAttempts, "err", he.err)
		if !sleepCtx(msg.Context(), retryBackoff(tries)) {
			return he.err
		}
	}
}

// handlerError is a handler's ordinary error (neither Fail nor Retry), or its panic.
type handlerError struct{ err error }

func (e *handlerError) Error() string { return e.err.Error() }
func (e *handlerError) Unwrap() error { return e.err }

func (p *Participant) handleOnce(msg *message.Message, phase outbox.SagaPhase, ref outbox.SagaRef, replyTo, key string, run stepRun) (err error) {
	ctx, span := startMessage(p.tr, msg, ref, p.cfg.Consumer)
	defer func() { endMessage(span, err) }()
	tx, err := p.cfg.Pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("saga participant %q: begin transaction: %w", p.cfg.Consumer, err)
	}
	defer rollback(tx)
	actionKey := barrierKey(ref.ID, ref.Step, outbox.SagaPhaseAction)
	compKey := barrierKey(ref.ID, ref.Step, outbox.SagaPhaseCompensation)
	// One round trip: the command's dedup claim, the savepoint that the handler's writes (and
	// the barrier's claims) roll back to on Fail or Retry, and the barrier. The claims lock
	// in one order (action key, then compensation key) in every transaction, so an action
	// and its compensation wait for each other instead of deadlocking.
	b := &pgx.Batch{}
	var fresh, actionFree, compFree, compensated bool
	var actionResult []byte
	if err := p.ib.QueueClaim(b, key, &fresh); err != nil {
		return err
	}
	b.Queue(`SAVEPOINT onceflow_saga_step`)
	if err := p.ib.QueueClaim(b, actionKey, &actionFree); err != nil {
		return err
	}
	if phase == outbox.SagaPhaseAction {
		// Read after the action key's claim, which waited for a concurrent compensation: if
		// that committed, its key is visible here.
		err = p.ib.QueueSeen(b, compKey, &compensated)
	} else {
		err = p.ib.QueueClaim(b, compKey, &compFree)
		// What the action returned, if it ran (read after the claim, which waited for it).
		b.Queue(p.resultSQL, p.cfg.Consumer, []string{actionKey}).Query(func(rows pgx.Rows) error {
			for rows.Next() {
				var k string
				if err := rows.Scan(&k, &actionResult); err != nil {
					return err
				}
			}
			return rows.Err()
		})
	}
	if err != nil {
		return err
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("saga participant %q: claim %s: %w", p.cfg.Consumer, key, schemaError(p.cfg.Schema, err))
	}
	if !fresh {
		p.skip(ref, BarrierDuplicate, "the same command again")
		return nil
	}
	var payload []byte
	var runErr error
	switch {
	case phase == outbox.SagaPhaseAction && !actionFree && compensated:
		p.skip(ref, BarrierHangingAction, "the action arrived after its compensation")
		return commit(ctx, tx) // keep this attempt's dedup row
	case phase == outbox.SagaPhaseAction && !actionFree:
		p.skip(ref, BarrierDuplicate, "an earlier attempt took effect; its reply is on its way")
		return commit(ctx, tx)
	case phase == outbox.SagaPhaseCompensation && actionFree:
		// The action never ran; its key is now taken, so it never will. Nothing to undo.
		p.skip(ref, BarrierNullCompensation, "the action never ran")
		payload = []byte("{}")
	case phase == outbox.SagaPhaseCompensation && !compFree:
		p.skip(ref, BarrierDuplicate, "an earlier attempt compensated; its reply is on its way")
		return commit(ctx, tx)
	default:
		payload, runErr = p.runHandler(ctx, tx, func(ctx context.Context, tx pgx.Tx) ([]byte, error) { return run(ctx, tx, msg, actionResult) })
	}
	outcome, reason := outbox.SagaOutcomeDone, ""
	var oe *outcomeError
	switch {
	case errors.As(runErr, &oe):
		outcome, reason, payload = oe.outcome, oe.reason, []byte("{}")
		if _, err := tx.Exec(ctx, `ROLLBACK TO SAVEPOINT onceflow_saga_step`); err != nil {
			return fmt.Errorf("saga participant %q: roll back the handler's writes: %w", p.cfg.Consumer, err)
		}
	case pgsql.IsTransient(runErr):
		return runErr // a deadlock, a lost connection: rolled back and redelivered, no try counted
	case runErr != nil:
		return &handlerError{runErr} // everything rolls back; handle tries again
	}
	// One round trip: the action's result kept with its barrier row, and the reply.
	b = &pgx.Batch{}
	if phase == outbox.SagaPhaseAction && outcome == outbox.SagaOutcomeDone {
		b.Queue(p.keepResultSQL, p.cfg.Consumer, actionKey, payload)
	}
	if err := p.cfg.Writer.QueueWriteTx(ctx, b, "", p.reply(msg, ref, replyTo, outcome, reason, payload)); err != nil {
		return fmt.Errorf("saga participant %q: write the reply: %w", p.cfg.Consumer, err)
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("saga participant %q: write the reply: %w", p.cfg.Consumer, schemaError(p.cfg.Schema, err))
	}
	return commit(ctx, tx)
}

// runHandler runs the handler on a view of tx that it cannot end. A handler that tried to end
// it (COMMIT in SQL) or left it aborted fails the command, whatever it returned: its writes
// cannot be trusted to be whole.
func (p *Participant) runHandler(ctx context.Context, tx pgx.Tx, run func(context.Context, pgx.Tx) ([]byte, error)) (payload []byte, err error) {
	view, done := pgsql.ManagedTx(tx, errTxManaged)
	func() {
		defer func() {
			if r := recover(); r != nil {
				err = fmt.Errorf("saga participant %q: the handler panicked: %v", p.cfg.Consumer, r)
			}
		}()
		payload, err = run(ctx, view)
	}()
	if misuse := done(); misuse != nil {
		return nil, fmt.Errorf("saga participant %q: %w", p.cfg.Consumer, misuse)
	}
	return payload, err
}

func (p *Participant) skip(ref outbox.SagaRef, o BarrierOutcome, why string) {
	p.cfg.Metrics.Barrier(p.cfg.Consumer, o)
	p.cfg.Logger.Debug("saga participant: command skipped", "consumer", p.cfg.Consumer, "saga_id", ref.ID,
		"step", ref.Step, "phase", ref.Phase, "attempt", ref.Attempt, "why", why)
}
