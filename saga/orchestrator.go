package saga

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/internal/config"
	"github.com/onceflow/onceflow/internal/engine"
	"github.com/onceflow/onceflow/internal/failure"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/tracing"
	"github.com/onceflow/onceflow/outbox"
)

// Orchestrator defaults.
const (
	// DefaultOrchestratorConsumer is the inbox consumer name the orchestrator records replies
	// under.
	DefaultOrchestratorConsumer = "onceflow-saga"
	// DefaultTimerInterval is how often Run looks for due timers: a timer fires at most about
	// this long after its deadline (plus the time to claim it).
	DefaultTimerInterval = 200 * time.Millisecond
	// DefaultTimerBatch bounds the timers fired in one transaction.
	DefaultTimerBatch = 50
)

// OrchestratorConfig configures an Orchestrator. Pool is required; the rest has defaults.
type OrchestratorConfig struct {
	// Pool holds the saga tables and the outbox. Required.
	Pool *pgxpool.Pool
	// Schema holds the saga tables, processed_event and the outbox. Default "onceflow".
	Schema string
	// Consumer is the inbox consumer under which replies are deduplicated. Default
	// DefaultOrchestratorConsumer. Keep it stable.
	Consumer string
	// Writer writes the commands; default outbox.NewWriter(outbox.Config{Schema: Schema}).
	Writer *outbox.Writer
	// TimerInterval is how often Run looks for due timers. Default DefaultTimerInterval.
	TimerInterval time.Duration
	// TimerBatch bounds the timers fired in one transaction. Default DefaultTimerBatch
	// (at most 60: each is one saga row lock held until the batch commits).
	TimerBatch int
	// Logger receives transitions that failed and ignored events (debug). Default
	// slog.Default().
	Logger *slog.Logger
	// Metrics receives the orchestrator's measurements. Default NopMetrics{}.
	Metrics Metrics
	// MaxAttempts is how often Handler tries a reply whose transition fails, with a backoff
	// from DefaultRetryBackoff doubling, before it sets the saga stuck with the error (and
	// records the reply in inbox_poison), so the reply partition moves on. Default
	// DefaultMaxAttempts. (The batched consumer has its own, inboxkafka.BatchConfig.MaxAttempts.)
	MaxAttempts int
	// CommitTimeout bounds the writes and the COMMIT that follow a computed transition (the
	// saga rows, timers and commands), which run detached from the message's cancellation: a
	// transition that was computed is kept, not redone, when the subscriber is closing.
	// Default inbox.DefaultCommitTimeout (30 s), as every consumer's; negative is refused.
	CommitTimeout time.Duration
	// TracerProvider records a `process <reply topic>` span per reply, child of the reply's
	// creation context, with the saga's id, step and state after the transition. Default
	// nil: the global provider. Propagator reads the creation context from the metadata;
	// default nil: the global one, or W3C trace context. Both also go to the default Writer.
	TracerProvider trace.TracerProvider
	Propagator     propagation.TextMapPropagator
}

// Orchestrator drives the sagas of the registered definitions: Handler consumes the
// participants' replies (through the inbox's dedup), Run fires the durable timers. Each
// transition — the reply's dedup row, the saga row, the next command in the outbox and the
// timers — commits in one transaction. Several orchestrators (processes) may run on one
// schema: replies are keyed by saga id, timers are claimed with SKIP LOCKED, and a saga row is
// locked while it changes.
type Orchestrator struct {
	cfg OrchestratorConfig
	run *engine.Runner // its transactions, dedup and poison rows (internal/engine)
	st  store

	mu   sync.RWMutex
	defs map[defKey]definition
	// maxLocal is the most savepoints one transition of a registered definition can take: its
	// local actions and local compensations, and an OnReplyTx handler (saga/local.go).
	maxLocal int
	tr       *tracing.Tracer    // trace.go
	retry    engine.RetryPolicy // Handler's, built once
}

// maxSavepoints bounds the savepoints of one transaction: beyond 64 subtransactions
// PostgreSQL's per-backend cache overflows and every snapshot slows down (DESIGN.md, Known
// traps).
const maxSavepoints = 60

// perTransaction is how many replies or timers one transaction may apply so that their local
// steps stay within maxSavepoints; 0 when no registered definition has local steps.
func (o *Orchestrator) perTransaction() int {
	o.mu.RLock()
	defer o.mu.RUnlock()
	if o.maxLocal == 0 {
		return 0
	}
	return max(1, maxSavepoints/o.maxLocal)
}

// timerBatch is TimerBatch, lowered so a batch's local steps stay within maxSavepoints.
func (o *Orchestrator) timerBatch() int {
	if n := o.perTransaction(); n > 0 {
		return min(o.cfg.TimerBatch, n)
	}
	return o.cfg.TimerBatch
}

type defKey struct {
	name    string
	version int
}

// NewOrchestrator validates cfg, reporting every problem at once (*ConfigError).
func NewOrchestrator(cfg OrchestratorConfig) (*Orchestrator, error) {
	if cfg.Schema == "" {
		cfg.Schema = pgsql.DefaultSchema
	}
	if cfg.Consumer == "" {
		cfg.Consumer = DefaultOrchestratorConsumer
	}
	if cfg.TimerInterval == 0 {
		cfg.TimerInterval = DefaultTimerInterval
	}
	if cfg.TimerBatch == 0 {
		cfg.TimerBatch = DefaultTimerBatch
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
		problems = append(problems, errors.New("Pool is nil; pass the *pgxpool.Pool of the database holding the saga tables"))
	}
	problems = append(problems, engine.Check(cfg.Pool, cfg.Schema, cfg.Consumer, cfg.CommitTimeout)...)
	if cfg.TimerInterval < 10*time.Millisecond {
		problems = append(problems, fmt.Errorf("TimerInterval is %s; use 0 for the default (%s) or at least 10ms", cfg.TimerInterval, DefaultTimerInterval))
	}
	if cfg.TimerBatch < 1 || cfg.TimerBatch > 60 {
		problems = append(problems, fmt.Errorf("TimerBatch is %d; use 0 for the default (%d) or 1..60", cfg.TimerBatch, DefaultTimerBatch))
	}
	if cfg.Writer == nil && len(problems) == 0 {
		var err error
		if cfg.Writer, err = outbox.NewWriter(outbox.Config{Schema: cfg.Schema, TracerProvider: cfg.TracerProvider, Propagator: cfg.Propagator}); err != nil {
			problems = append(problems, err)
		}
	}
	if err := config.Check("saga orchestrator", problems...); err != nil {
		return nil, err
	}
	run := engine.New(engine.Config{Pool: cfg.Pool, Schema: cfg.Schema, Consumer: cfg.Consumer,
		What: fmt.Sprintf("saga orchestrator %q", cfg.Consumer), CommitTimeout: cfg.CommitTimeout, Logger: cfg.Logger})
	return &Orchestrator{cfg: cfg, run: run, st: newStore(cfg.Schema), defs: map[defKey]definition{},
		retry: engine.NewRetryPolicy(cfg.MaxAttempts, 0, 0, cfg.Logger),
		tr:    tracing.New(cfg.TracerProvider, cfg.Propagator)}, nil
}

// Register adds a definition to the orchestrator. Register every version that may still have
// running sagas; registering the same name and version twice is refused.
func Register[D any](o *Orchestrator, def *Definition[D]) error {
	if def == nil {
		return errors.New("saga: Register with a nil definition")
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	k := defKey{def.Name(), def.Version()}
	if _, dup := o.defs[k]; dup {
		return fmt.Errorf("saga: definition %q version %d is registered already", k.name, k.version)
	}
	o.defs[k] = def
	// Savepoints one transition can take: one per local action and local compensation (each
	// runs at most once in a transition), and one for an OnReplyTx handler (a transition
	// applies one reply).
	n, replyTx := 0, 0
	for i := range def.stepCount() {
		p := def.step(i)
		if p.local {
			n++
		}
		if p.compLocal {
			n++
		}
		if p.replyTx {
			replyTx = 1
		}
	}
	o.maxLocal = max(o.maxLocal, n+replyTx)
	return nil
}

// Config returns the configuration with defaults filled in.
func (o *Orchestrator) Config() OrchestratorConfig { return o.cfg }

// Metrics returns the orchestrator's Metrics, for StartTx's WithMetrics.
func (o *Orchestrator) Metrics() Metrics { return o.cfg.Metrics }

// ReplyTopics returns the reply topics of the registered definitions, sorted, without
// duplicates: subscribe Handler to each.
func (o *Orchestrator) ReplyTopics() []string {
	o.mu.RLock()
	defer o.mu.RUnlock()
	set := map[string]bool{}
	for _, d := range o.defs {
		set[d.replyTopic()] = true
	}
	out := make([]string, 0, len(set))
	for t := range set {
		out = append(out, t)
	}
	sort.Strings(out)
	return out
}

func (o *Orchestrator) lookup(name string, version int) (definition, error) {
	o.mu.RLock()
	defer o.mu.RUnlock()
	d, ok := o.defs[defKey{name, version}]
	if !ok {
		return nil, fmt.Errorf("saga: definition %q version %d is not registered with this orchestrator; "+
			"keep every version with running sagas registered (saga.Register) until they finish", name, version)
	}
	return d, nil
}

// Handler is the Watermill handler of the reply topics: register it with
// router.AddConsumerHandler for each of ReplyTopics (with inboxkafka's subscriber settings).
// It must not run behind the inbox middleware: it deduplicates replies itself, in the
// transition's transaction.
//
// It is the batch engine (ProcessBatch) with a batch of one, tried again by the same policy
// as the batched consumer's: a reply whose transition fails is tried MaxAttempts times with
// backoff, then its saga is set stuck (SettlePoison); a failure of the transaction as a whole
// (the database unreachable or restarting, a deadlock) counts no attempt and is retried until
// the message's context ends, so an outage never makes a saga stuck.
func (o *Orchestrator) Handler(msg *message.Message) error {
	if _, _, ok := o.readReply(msg); !ok {
		return nil
	}
	return o.retry.ApplyOne(msg.Context(), o, msg, "", nil)
}

// advance computes the transition of one event on a locked saga and runs what it asks to run
// in tx (OnReplyTx, local steps, the ending hook); storing it is the caller's. Replies
// (ProcessBatch) and timers (fireBatch) both go through it. A panic in the definition's code
// is returned as an error.
func (o *Orchestrator) advance(ctx context.Context, tx pgx.Tx, def definition, in *instance, now time.Time, ev event) (*effects, error) {
	fx, err := engine.Call(func() (*effects, error) {
		m := &machine{def: def, now: now, in: in, replyTx: runReplyTx(ctx, tx, def, in)}
		if err := m.apply(ev); err != nil {
			return nil, err
		}
		if m.fx.stale != "" {
			return &m.fx, nil // nothing changes; a reply's dedup row still commits
		}
		return &m.fx, runLocals(ctx, tx, m)
	})
	if err != nil {
		return nil, fmt.Errorf("saga %q (%s): %w", in.ID, in.Name, err)
	}
	return fx, nil
}

func (o *Orchestrator) observe(in *instance, fx *effects, now time.Time) {
	observeLocal(o.cfg.Metrics, in, fx)
	switch {
	case fx.stale != "":
		o.cfg.Metrics.Ignored(in.Name)
		o.cfg.Logger.Debug("saga: event ignored", "saga_id", in.ID, "saga", in.Name, "why", fx.stale)
	case fx.finished == StateCompleted:
		o.cfg.Metrics.Completed(in.Name, now.Sub(in.CreatedAt))
	case fx.finished == StateCompensated:
		o.cfg.Metrics.Compensated(in.Name, now.Sub(in.CreatedAt))
	case fx.becameStuck:
		o.cfg.Metrics.Stuck(in.Name)
		o.cfg.Logger.Error("saga: stuck; resume it with `onceflow saga retry` once the cause is fixed",
			"saga_id", in.ID, "saga", in.Name, "error", in.Error)
	}
}

// runBackoffCap bounds Run's wait between rounds after failures: once the database is back
// (or migrated), timers fire again within this long.
const runBackoffCap = 10 * time.Second

// Run fires due timers (step timeouts, re-sends, deadlines, operator requests) every
// TimerInterval until ctx ends, and returns nil then. Run it in every orchestrator process:
// each timer fires once, in the transaction that applies its transition.
//
// A round that fails (the database unreachable, the schema not migrated: errors.Is(err,
// migrations.ErrNotMigrated)) is logged, one line per failed round saying how long Run waits
// before the next; the wait doubles from TimerInterval up to 10 s while the rounds keep
// failing, so a broken database is not hammered (nor its log filled), and one line says
// when rounds work again. Call CheckSchema at start-up to refuse an unmigrated schema at
// once instead.
//
// While it runs, Run records the orchestrator and its registered definition versions in
// saga_orchestrator (refreshed every OrchestratorHeartbeat, deleted when Run returns), which
// Admin.Versions and `onceflow saga versions` read; a failure to record it is logged and
// never holds up the timers.
func (o *Orchestrator) Run(ctx context.Context) error {
	defer o.heartbeat(ctx)() // its saga_orchestrator row (registry.go), deleted on return
	t := time.NewTimer(o.cfg.TimerInterval)
	defer t.Stop()
	var (
		failures int // rounds failed in a row
		since    time.Time
	)
	for {
		err := o.round(ctx) // parked.go: parked replies, then due timers
		if ctx.Err() != nil {
			return nil
		}
		wait := o.cfg.TimerInterval
		switch {
		case err != nil:
			failures++
			if failures == 1 {
				since = time.Now()
			}
			wait = failure.Backoff(o.cfg.TimerInterval, max(runBackoffCap, o.cfg.TimerInterval), failures)
			o.cfg.Logger.Error("saga: a round of parked replies and due timers failed; backing off before the next round",
				"err", err, "retry_in", wait, "failures", failures)
		case failures > 0:
			o.cfg.Logger.Info("saga: parked replies and due timers work again", "failures", failures,
				"failing_for", time.Since(since).Round(time.Millisecond))
			failures = 0
		}
		t.Reset(wait)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// fireAll fires batches of due timers until a batch is not full.
func (o *Orchestrator) fireAll(ctx context.Context) error {
	for {
		n, err := o.FireDue(ctx)
		if err != nil || n < o.timerBatch() {
			return err
		}
	}
}

// FireDue fires the timers due now, up to TimerBatch of them, in one transaction, and returns
// how many it fired. Run calls it; tests and single-process harnesses may call it directly.
// Only timers of sagas whose definition version is registered here are claimed: another
// orchestrator, that has the version, fires the others (a rolling deploy).
// When a timer's transition fails, the batch's timers are fired one per transaction, so one
// saga whose transition keeps failing (it is postponed by a minute and logged) cannot hold up
// the others. Any other failure (claiming the timers, the database) is returned as it is:
// firing one at a time would only fail the same way.
func (o *Orchestrator) FireDue(ctx context.Context) (int, error) {
	n, err := o.fireBatch(ctx, o.timerBatch())
	var failed *timerError
	if err == nil || ctx.Err() != nil || !errors.As(err, &failed) {
		return n, err
	}
	o.cfg.Logger.Warn("saga: a timer's transition failed, so its batch was rolled back; firing the batch's timers one at a time",
		"saga_id", failed.sagaID, "kind", failed.kind, "err", failed.err)
	fired := 0
	for range o.timerBatch() {
		n, err := o.fireBatch(ctx, 1)
		var te *timerError
		switch {
		case errors.As(err, &te) && errors.Is(te.err, engine.ErrPanicked):
			// Firing it again would only panic again: the saga stops, with the panic as its
			// error, until an operator resumes it.
			o.cfg.Logger.Error("saga: stuck: a timer's transition panicked; resume it with `onceflow saga retry` once the cause is fixed",
				"saga_id", te.sagaID, "kind", te.kind, "err", te.err)
			if serr := o.stuckByTimer(ctx, te); serr != nil {
				return fired, serr
			}
		case errors.As(err, &te):
			o.cfg.Logger.Error("saga: a timer's transition failed; postponed by a minute", "saga_id", te.sagaID, "kind", te.kind, "err", te.err)
			if perr := o.postpone(ctx, te.sagaID, te.kind); perr != nil {
				return fired, perr
			}
		case err != nil:
			return fired, err
		case n == 0:
			return fired, nil
		}
		fired += n
	}
	return fired, nil
}

// timerError is a transition of one timer that failed.
type timerError struct {
	sagaID, kind string
	err          error
}

func (e *timerError) Error() string {
	return fmt.Sprintf("saga %q, %s timer: %v", e.sagaID, e.kind, e.err)
}
func (e *timerError) Unwrap() error { return e.err }

// stuckByTimer sets the saga of a timer whose transition panicked stuck with the panic, and
// deletes the timer, in one transaction.
func (o *Orchestrator) stuckByTimer(ctx context.Context, te *timerError) error {
	var name string
	err := o.run.InTx(ctx, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, o.st.delTimer, te.sagaID, te.kind); err != nil {
			return err
		}
		err := tx.QueryRow(ctx, o.st.stuck, te.sagaID, fmt.Sprintf("the %s timer could not be applied: %v", te.kind, te.err)).Scan(&name)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil // stuck already (an operator's retry panicked) or finished
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("saga: set saga %q stuck: %w", te.sagaID, o.st.explain(err))
	}
	if name != "" {
		o.cfg.Metrics.Stuck(name)
	}
	return nil
}

func (o *Orchestrator) postpone(ctx context.Context, sagaID, kind string) error {
	_, err := o.cfg.Pool.Exec(ctx, `UPDATE `+pgsql.Table(o.cfg.Schema, "saga_timer")+
		` SET due_at = now() + interval '1 minute' WHERE saga_id = $1 AND kind = $2`, sagaID, kind)
	if err != nil {
		return fmt.Errorf("saga: postpone the %s timer of saga %q: %w", kind, sagaID, o.st.explain(err))
	}
	return nil
}

// fireBatch fires up to limit due timers in one transaction of the engine (timerBatch) and
// returns how many it fired.
func (o *Orchestrator) fireBatch(ctx context.Context, limit int) (int, error) {
	u := &timerBatch{o: o, limit: limit}
	res, err := o.run.Run(ctx, limit, u)
	for _, f := range u.fired {
		endMessage(f.span, err)
		if err == nil && res.Outcome == engine.Applied {
			o.observe(f.in, f.fx, f.now)
		}
	}
	return len(res.Applied), err
}

// timerBatch is the orchestrator's part of a transaction of due timers (engine.Unit): each
// timer is claimed with its saga row (SKIP LOCKED), deleted, and its transition applied and
// stored.
type timerBatch struct {
	o     *Orchestrator
	limit int
	fired []firedTimer
}

type firedTimer struct {
	in   *instance
	fx   *effects
	now  time.Time
	span trace.Span
}

// Apply implements engine.Unit. A transition that fails is a *timerError naming its saga.
func (u *timerBatch) Apply(ctx context.Context, tx pgx.Tx) ([]int, error) {
	o := u.o
	dues, err := o.st.claimDueTx(ctx, tx, u.limit, o.registered())
	if err != nil {
		return nil, err
	}
	applied := make([]int, 0, len(dues))
	for i, d := range dues {
		in, now, err := o.st.load(ctx, tx, d.sagaID, true)
		if err != nil {
			return nil, &timerError{d.sagaID, d.t.Kind, err}
		}
		if d.t.Kind == timerOperator && d.t.Action == actUpgrade {
			// Needs the definition to upgrade to, not the saga's own (upgrade_apply.go).
			if err := o.upgradeRequested(ctx, tx, in, now, d.t); err != nil {
				return nil, &timerError{d.sagaID, d.t.Kind, err}
			}
			applied = append(applied, i)
			continue
		}
		def, err := o.lookup(in.Name, in.Version)
		if err != nil {
			return nil, &timerError{d.sagaID, d.t.Kind, err}
		}
		// The timer fires once: deleted in this transaction, before the transition may set the
		// next one of its kind.
		if _, err := tx.Exec(ctx, o.st.delTimer, d.sagaID, d.t.Kind); err != nil {
			return nil, fmt.Errorf("saga: delete timer: %w", o.st.explain(err))
		}
		t := d.t
		tctx, span := startTimer(ctx, o.tr, in, t)
		fx, err := o.advance(tctx, tx, def, in, now, event{timer: &t})
		if err == nil && fx.stale == "" {
			err = o.st.saveTx(tctx, tx, o.cfg.Writer, in, fx)
		}
		u.fired = append(u.fired, firedTimer{in, fx, now, span})
		if err != nil {
			return nil, &timerError{d.sagaID, d.t.Kind, err}
		}
		noteTransition(tctx, in, fx)
		applied = append(applied, i)
	}
	return applied, nil
}

// Write implements engine.Unit: each transition was stored as it was applied.
func (u *timerBatch) Write(context.Context, pgx.Tx) error { return nil }

// observeLocal counts a committed transition's local runs.
func observeLocal(m Metrics, in *instance, fx *effects) {
	for _, r := range fx.ran {
		m.LocalStep(in.Name, r.Step, r.Phase, r.Outcome)
	}
}
