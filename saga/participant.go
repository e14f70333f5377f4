package saga

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/internal/config"
	"github.com/onceflow/onceflow/internal/engine"
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
	// after is the wait a handler asked for with inbox.RetryAfter (outcome retry).
	after time.Duration
}

// outcomeOf is err's typed outcome, if it has one: Fail, Retry, or an inbox.RetryAfter, which a
// saga step answers as Retry with its wait (the orchestrator re-sends no sooner: the saga,
// not the participant's partition, holds the wait).
func outcomeOf(err error) *outcomeError {
	var oe *outcomeError
	if errors.As(err, &oe) {
		return oe
	}
	if rl := engine.AsRetryLater(err); rl != nil {
		return &outcomeError{outcome: outbox.SagaOutcomeRetry, reason: rl.Err.Error(), err: err, after: rl.After}
	}
	return nil
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
	// CommitTimeout bounds the writes and the COMMIT that follow successful handlers (the
	// replies, the barrier's results), which run detached from the message's cancellation.
	// Default inbox.DefaultCommitTimeout (30 s), as every consumer's; negative is refused.
	CommitTimeout time.Duration
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
	run *engine.Runner  // its transactions, dedup and poison rows (internal/engine)
	tr  *tracing.Tracer // trace.go
	// keepResultSQL stores actions' results with their barrier rows; resultSQL reads them.
	keepResultSQL, resultSQL string
	// releaseSQL deletes a barrier key claimed for commands that turned out to be duplicates.
	releaseSQL string
	// retry is the policy of the per-message handlers (Action, Compensation), built once.
	retry engine.RetryPolicy
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
	if cfg.CommitTimeout == 0 {
		cfg.CommitTimeout = engine.DefaultCommitTimeout
	}
	var problems []error
	if cfg.MaxAttempts < 1 {
		problems = append(problems, fmt.Errorf("MaxAttempts is %d; use 0 for the default (%d) or a positive number", cfg.MaxAttempts, DefaultMaxAttempts))
	}
	if cfg.Pool == nil {
		problems = append(problems, errors.New("Pool is nil; pass the *pgxpool.Pool of the database holding processed_event and the outbox"))
	}
	problems = append(problems, engine.Check(cfg.Pool, cfg.Schema, cfg.Consumer, cfg.CommitTimeout)...)
	if cfg.Writer == nil {
		w, err := outbox.NewWriter(outbox.Config{Schema: cfg.Schema, TracerProvider: cfg.TracerProvider, Propagator: cfg.Propagator})
		if err != nil {
			problems = append(problems, err)
		}
		cfg.Writer = w
	}
	if err := config.Check("saga participant", problems...); err != nil {
		return nil, err
	}
	pe := pgsql.Table(cfg.Schema, "processed_event")
	run := engine.New(engine.Config{Pool: cfg.Pool, Schema: cfg.Schema, Consumer: cfg.Consumer,
		What: fmt.Sprintf("saga participant %q", cfg.Consumer), CommitTimeout: cfg.CommitTimeout, Logger: cfg.Logger})
	return &Participant{cfg: cfg, run: run, tr: tracing.New(cfg.TracerProvider, cfg.Propagator),
		// One statement per action, pipelined: an UPDATE … FROM unnest(…) is planned for 100
		// rows and may scan the whole table instead of using the primary key.
		keepResultSQL: `UPDATE ` + pe + ` SET result = $3 WHERE consumer = $1 AND dedup_key = $2`,
		// One index probe per key (not `dedup_key = ANY($2)`, whose generic plan, made while the
		// table was small, can read every row of the consumer until the next ANALYZE).
		resultSQL: `SELECT u.k, r.result FROM unnest($2::text[]) AS u(k) CROSS JOIN LATERAL (SELECT result FROM ` + pe +
			` WHERE consumer = $1 AND dedup_key = u.k LIMIT 1) AS r`,
		// One statement per key, pipelined, like keepResultSQL (a DELETE by `ANY($2)` or a join
		// with unnest(…) gets plans that read every row of the consumer).
		releaseSQL: `DELETE FROM ` + pe + ` WHERE consumer = $1 AND dedup_key = $2`,
		retry:      engine.NewRetryPolicy(cfg.MaxAttempts, 0, 0, cfg.Logger.With("consumer", cfg.Consumer)),
	}, nil
}

// Action returns the Watermill handler of a step's command: it decodes the command (JSON) into
// C, runs h in the command's transaction and replies with h's result R (JSON). h returns
// Fail(reason) for a business failure, Retry(err) for a transient one. Any other error (or a
// panic) rolls the attempt back and runs it again, up to ParticipantConfig.MaxAttempts times
// with backoff; then the command is answered as a failed attempt carrying the error, so its
// partition moves on and the saga retries or compensates. That includes errors that only look
// like network errors: a provider's HTTP error, a deadline, a decoder's io.EOF. Only a failure
// of the transaction's own connection or server (a deadlock, a lost connection, a restart)
// counts no attempt and is retried until it succeeds. h must not commit or roll back tx
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
// barrier row was removed while the saga lived (by hand, or by an inbox cleaner that could
// not see the saga: CleanerConfig.Sagas) — the saga's data then holds what OnReply stored.
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

// handle runs one command: the batch engine (stepProcessor) with a batch of one, tried again
// while its handler fails with an ordinary error and then answered as a failed attempt (see
// Action), by the same policy as the batched consumer's. A failure of the transaction as a
// whole (the database unreachable, a deadlock) counts no attempt and is retried until the
// message's context ends; then its error is returned, so the router redelivers the command.
func (p *Participant) handle(msg *message.Message, phase outbox.SagaPhase, run stepRun) error {
	if _, _, _, err := p.readCommand(msg, phase); err != nil {
		// Poison: no retry can fix it; inbox.IsPoison is true so a poison queue takes it.
		return err
	}
	sp := &stepProcessor{p: p, phase: phase, run: run}
	return p.retry.ApplyOne(msg.Context(), sp, msg, "", nil)
}

// commandBatch is a participant's part of a transaction of commands (engine.Unit): their
// dedup keys claimed in one statement, the barrier's keys claimed and read in one round trip
// and decided by decideBarrier, the handlers run in order, the actions' results and every
// reply written in one round trip. When a handler returns Fail or Retry, Apply stops with a
// *decided error (nothing is kept): the caller runs the batch again with that outcome decided.
type commandBatch struct {
	p     *Participant
	phase outbox.SagaPhase
	cmds  []*command
	run   stepRun
	// Write's: barrier keys to give back, the actions' results to keep with their barrier
	// rows, and the replies (origin[i]: the index in the batch of the command replies[i]
	// answers).
	release, kept []string
	keptResults   [][]byte
	replies       []*message.Message
	origin        []int
}

// decided is a handler's Fail or Retry: its batch is rolled back and run again with the
// outcome of cmds[index] decided.
type decided struct {
	index   int
	outcome *outcomeError
}

func (d *decided) Error() string { return d.outcome.Error() }

// Apply implements engine.Unit.
func (u *commandBatch) Apply(ctx context.Context, tx pgx.Tx) ([]int, error) {
	bc, err := u.p.claim(ctx, tx, u.cmds)
	if err != nil || len(bc.fresh) == 0 {
		return nil, err // all duplicates: nothing to commit
	}
	u.release = bc.release
	applied := make([]int, 0, len(bc.fresh))
	for i, c := range bc.fresh {
		applied = append(applied, c.index) // its dedup row commits
		payload, outcome, reason := []byte("{}"), outbox.SagaOutcomeDone, ""
		var replyCtx context.Context
		actionKey := barrierKey(c.ref.ID, c.ref.Step, outbox.SagaPhaseAction)
		switch bc.verdicts[i] {
		case verdictDecided:
			outcome, reason = c.outcome.outcome, c.outcome.reason
		case verdictHanging:
			u.p.skip(c.ref, BarrierHangingAction, "the action arrived after its compensation")
			continue // no reply
		case verdictTookEffect:
			u.p.skip(c.ref, BarrierDuplicate, "an earlier attempt took effect; answered with the result it kept")
			if r := bc.results[actionKey]; r != nil {
				payload = r
			}
		case verdictRefused:
			// The action key claimed for it is given back: the record stays missing, and a
			// later retry is refused the same way until an operator has checked.
			u.release = append(u.release, actionKey)
			outcome = outbox.SagaOutcomeRefused
			reason = fmt.Sprintf("participant %q has no record of step %q's action, which the orchestrator knows took effect "+
				"(its barrier row was removed: by hand, or by an inbox cleaner that could not see the saga — see CleanerConfig.Sagas); "+
				"running it again could apply it twice. Check whether it took effect, then compensate or finish the saga by hand",
				u.p.cfg.Consumer, c.ref.Step)
			u.p.cfg.Metrics.Barrier(u.p.cfg.Consumer, BarrierRefused)
			u.p.cfg.Logger.Error("saga participant: command refused: "+reason, "saga_id", c.ref.ID, "attempt", c.ref.Attempt)
		case verdictCompensated:
			u.p.skip(c.ref, BarrierDuplicate, "an earlier attempt compensated; answered as done")
		case verdictNullCompensation:
			// The action never ran; its key is now taken, so it never will. Nothing to undo.
			u.p.skip(c.ref, BarrierNullCompensation, "the action never ran")
		case verdictRun:
			if replyCtx, payload, err = u.runStep(ctx, tx, c, bc.results[actionKey]); err != nil {
				return nil, err
			}
			if u.phase == outbox.SagaPhaseAction {
				bc.results[actionKey] = payload // a later attempt in this batch is answered with it
				u.kept = append(u.kept, actionKey)
				u.keptResults = append(u.keptResults, payload)
			}
		}
		reply := u.p.reply(c.msg, c.ref, c.replyTo, outcome, reason, payload)
		if bc.verdicts[i] == verdictDecided && c.outcome.after > 0 {
			reply.Metadata.Set(outbox.MetadataSagaRetryAfter, c.outcome.after.String())
		}
		if bc.verdicts[i] == verdictRun {
			reply.SetContext(replyCtx) // its `create` span continues the command's trace
		}
		u.replies = append(u.replies, reply)
		u.origin = append(u.origin, c.index)
	}
	return applied, nil
}

// runStep runs the step's handler for c in its `process` span and returns the span's context
// and the reply's payload. Fail and Retry come back as *decided; any other error is blamed by
// the engine's rule (the transaction's, or the command's).
func (u *commandBatch) runStep(ctx context.Context, tx pgx.Tx, c *command, actionResult []byte) (context.Context, []byte, error) {
	mctx, span := startMessage(u.p.tr, c.msg, c.ref, u.p.cfg.Consumer)
	out, err := u.p.runHandler(mctx, tx, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		return u.run(ctx, tx, c.msg, actionResult)
	})
	endMessage(span, err)
	if oe := outcomeOf(err); oe != nil {
		return nil, nil, &decided{c.index, oe}
	}
	return mctx, out, engine.Blame(ctx, err, tx.Conn(), c.index)
}

// Write implements engine.Unit: one round trip with the barrier keys claimed for duplicates
// given back, the actions' results kept with their barrier rows, and every reply.
func (u *commandBatch) Write(ctx context.Context, tx pgx.Tx) error {
	p := u.p
	b := &pgx.Batch{}
	for _, k := range u.release {
		b.Queue(p.releaseSQL, p.cfg.Consumer, k)
	}
	for i, k := range u.kept {
		b.Queue(p.keepResultSQL, p.cfg.Consumer, k, u.keptResults[i])
	}
	if len(u.replies) > 0 {
		if err := p.cfg.Writer.QueueWriteTx(ctx, b, "", u.replies...); err != nil {
			return engine.Refused(fmt.Errorf("saga participant %q: write %d replies: %w", p.cfg.Consumer, len(u.replies), err), u.origin)
		}
	}
	if b.Len() == 0 {
		return nil
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("saga participant %q: write %d replies: %w", p.cfg.Consumer, len(u.replies), schemaError(p.cfg.Schema, err))
	}
	return nil
}

// barrierClaim is what claim found: the commands not seen before (fresh, in batch order),
// each with its barrier verdict; what the steps' actions kept, by action key (for
// compensations, and for later attempts of actions that took effect); and the barrier keys
// claimed only for commands that turned out to be duplicates, given back before the commit.
type barrierClaim struct {
	fresh    []*command
	verdicts []barrierVerdict
	results  map[string][]byte
	release  []string
}

// barrierKeys are the keys of a batch's claims: the commands' dedup keys, the barrier keys to
// claim (each step's action key, a compensation's own key too), the compensation keys only to
// look up, and the action keys whose kept results to read.
type barrierKeys struct {
	commands, claim, seen, read []string
	claiming, reading           map[string]bool
	// sagas[i] is the saga of claim[i], kept with its barrier row (retention keeps the rows
	// of sagas that are alive).
	sagas []string
}

// plan lists the barrier keys of the commands whose outcome is not decided. Claims lock in key
// order — an action key sorts before its compensation's — so an action and its compensation
// wait for each other instead of deadlocking.
func plan(cmds []*command) barrierKeys {
	k := barrierKeys{commands: make([]string, len(cmds)), claiming: map[string]bool{}, reading: map[string]bool{}}
	add := func(list *[]string, set map[string]bool, key string) {
		if !set[key] {
			set[key] = true
			*list = append(*list, key)
		}
	}
	for i, c := range cmds {
		k.commands[i] = c.key
		if c.outcome != nil {
			continue
		}
		claim := func(key string) {
			if !k.claiming[key] {
				k.sagas = append(k.sagas, c.ref.ID)
			}
			add(&k.claim, k.claiming, key)
		}
		actionKey := barrierKey(c.ref.ID, c.ref.Step, outbox.SagaPhaseAction)
		claim(actionKey)
		if c.ref.Phase == outbox.SagaPhaseCompensation || c.ref.Attempt > 1 {
			// A compensation reads what its action kept, a later attempt what an earlier one
			// kept. A first attempt finds its action key taken only by a compensation (it is
			// then skipped) or after its own dedup row was removed (read after the claims).
			add(&k.read, k.reading, actionKey)
		}
		if c.ref.Phase == outbox.SagaPhaseCompensation {
			claim(barrierKey(c.ref.ID, c.ref.Step, outbox.SagaPhaseCompensation))
		}
	}
	for _, c := range cmds {
		if compKey := barrierKey(c.ref.ID, c.ref.Step, outbox.SagaPhaseCompensation); c.outcome == nil && !k.claiming[compKey] {
			k.seen = append(k.seen, compKey)
		}
	}
	return k
}

// taken says, for each barrier key, whether it existed before this transaction: got[i] is
// whether the claim of k.claim[i] inserted it (k.claim holds distinct keys), seen[i] whether
// k.seen[i] was found.
func (k barrierKeys) taken(got, seen []bool) map[string]bool {
	taken := make(map[string]bool, len(k.claim)+len(k.seen))
	for i, key := range k.claim {
		taken[key] = !got[i]
	}
	for i, key := range k.seen {
		taken[key] = taken[key] || seen[i]
	}
	return taken
}

// claim claims the commands' dedup keys and the barrier's keys in one round trip, and decides
// each new command (decideBarrier). An action's batch reads which compensations committed after
// its claims, which waited for concurrent compensations. The barrier keys are claimed before the
// commands' claims are known (one round trip rather than two), hence release.
func (p *Participant) claim(ctx context.Context, tx pgx.Tx, cmds []*command) (*barrierClaim, error) {
	k := plan(cmds)
	var claimed, got, seen []bool
	bc := &barrierClaim{results: map[string][]byte{}}
	b := &pgx.Batch{}
	if err := p.run.QueueClaim(b, k.commands, &claimed); err != nil {
		return nil, err
	}
	if len(k.claim) > 0 {
		if err := p.run.QueueClaimSaga(b, k.claim, k.sagas, &got); err != nil {
			return nil, err
		}
		if len(k.seen) > 0 {
			if err := p.run.QueueSeen(b, k.seen, &seen); err != nil {
				return nil, err
			}
		}
		if len(k.read) > 0 {
			p.queueResults(b, k.read, bc.results)
		}
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, fmt.Errorf("saga participant %q: claim %d commands and their barrier: %w", p.cfg.Consumer, len(cmds), schemaError(p.cfg.Schema, err))
	}
	taken := k.taken(got, seen)
	used := map[string]bool{} // barrier keys of new commands
	var unread []string       // action keys taken before whose results were not read
	for i, c := range cmds {
		if !claimed[i] {
			p.skip(c.ref, BarrierDuplicate, "the same command again")
			continue
		}
		bc.fresh = append(bc.fresh, c)
		if c.outcome == nil {
			actionKey := barrierKey(c.ref.ID, c.ref.Step, outbox.SagaPhaseAction)
			used[actionKey], used[barrierKey(c.ref.ID, c.ref.Step, outbox.SagaPhaseCompensation)] = true, true
			if taken[actionKey] && !k.reading[actionKey] {
				k.reading[actionKey] = true
				unread = append(unread, actionKey)
			}
		}
	}
	if len(unread) > 0 {
		b := &pgx.Batch{}
		p.queueResults(b, unread, bc.results)
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return nil, fmt.Errorf("saga participant %q: read %d actions' results: %w", p.cfg.Consumer, len(unread), schemaError(p.cfg.Schema, err))
		}
	}
	for i, key := range k.claim {
		if got[i] && !used[key] {
			bc.release = append(bc.release, key) // claimed for a duplicate only
		}
	}
	bc.verdicts = decide(bc.fresh, taken)
	return bc, nil
}

// decide runs decideBarrier on the new commands, with what each step's barrier keys held
// before this transaction (taken).
func decide(fresh []*command, taken map[string]bool) []barrierVerdict {
	before := map[stepID]barrierState{}
	in := make([]barrierCmd, len(fresh))
	for i, c := range fresh {
		before[stepID{c.ref.ID, c.ref.Step}] = barrierState{
			ActionTaken: taken[barrierKey(c.ref.ID, c.ref.Step, outbox.SagaPhaseAction)],
			CompTaken:   taken[barrierKey(c.ref.ID, c.ref.Step, outbox.SagaPhaseCompensation)],
		}
		in[i] = barrierCmd{Saga: c.ref.ID, Step: c.ref.Step, Phase: c.ref.Phase, Decided: c.outcome != nil,
			TookEffect: c.msg.Metadata.Get(outbox.MetadataSagaTookEffect) == "true"}
	}
	return decideBarrier(in, before)
}

// queueResults queues the read of what the actions of keys kept into results.
func (p *Participant) queueResults(b *pgx.Batch, keys []string, results map[string][]byte) {
	b.Queue(p.resultSQL, p.cfg.Consumer, keys).Query(func(rows pgx.Rows) error {
		for rows.Next() {
			var k string
			var r []byte
			if err := rows.Scan(&k, &r); err != nil {
				return err
			}
			results[k] = r
		}
		return rows.Err()
	})
}

// runHandler runs the handler on a view of tx that it cannot end. A handler that tried to end
// it (COMMIT in SQL) or left it aborted fails the command, whatever it returned: its writes
// cannot be trusted to be whole.
func (p *Participant) runHandler(ctx context.Context, tx pgx.Tx, run func(context.Context, pgx.Tx) ([]byte, error)) ([]byte, error) {
	view, done := pgsql.ManagedTx(tx, errTxManaged)
	payload, err := engine.Call(func() ([]byte, error) { return run(ctx, view) })
	// The handler's own error wins: it says why the transaction is aborted (a deadlock is
	// the transaction's, not the command's).
	if misuse := done(); misuse != nil && err == nil {
		return nil, fmt.Errorf("saga participant %q: %w", p.cfg.Consumer, misuse)
	}
	return payload, err
}

func (p *Participant) skip(ref outbox.SagaRef, o BarrierOutcome, why string) {
	p.cfg.Metrics.Barrier(p.cfg.Consumer, o)
	p.cfg.Logger.Debug("saga participant: command skipped", "consumer", p.cfg.Consumer, "saga_id", ref.ID,
		"step", ref.Step, "phase", ref.Phase, "attempt", ref.Attempt, "why", why)
}
