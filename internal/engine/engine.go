// Package engine is the one transaction runner every onceflow consumer uses: the inbox (the
// router's middleware and the batched consumer's processors), the saga orchestrator (replies
// and timers), saga participants, and the replay of given-up messages.
//
// A Runner owns what every consumer's transaction shares, so each decision lives in one place:
//
//   - a connection slot of the pool (at most MaxConns − 1 transactions in flight across every
//     consumer on a pool, so a handler that takes one more connection from it cannot wait
//     forever) and the consumer's turn while its rows are hot (TakeTurns);
//   - BEGIN, a pre-claim hook (Starter: a replay's state change), the consumer's middle (Unit:
//     claim the dedup keys, run the handlers, queue what commits with them), and the writes
//     and COMMIT on a context detached from the message's cancellation, bounded by one commit
//     timeout (Config.CommitTimeout, DefaultCommitTimeout);
//   - the rollback of a transaction that did not commit, bounded and logged when it fails;
//   - whose a failure is (Blame, blameCommit: the rule of internal/failure), an outbox refusal
//     mapped back to the message it came from (Refused), and one panic policy (Call: a
//     handler's panic is its message's error, wrapping ErrPanicked);
//   - one retry policy (RetryPolicy), the poison record (GiveUpTx) and the replay loop.
//
// It imports no public onceflow package (DESIGN.md: internal is the ground floor); the public
// packages re-export what users see (inbox.BatchProcessor, inbox.MessageError, …) as aliases.
package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/failure"
	"github.com/onceflow/onceflow/internal/pgsql"
)

// DefaultCommitTimeout is the default Config.CommitTimeout of every consumer.
const DefaultCommitTimeout = 30 * time.Second

// rollbackTimeout bounds a rollback. It runs on a context detached from the message's, so a
// cancelled or timed-out message still releases its connection cleanly.
const rollbackTimeout = 10 * time.Second

// Config configures a Runner; Check validates it.
type Config struct {
	// Pool opens the transactions. Required; MaxConns at least 2 (see slots).
	Pool *pgxpool.Pool
	// Schema holds processed_event and inbox_poison.
	Schema string
	// Consumer names the consumer in the dedup rows, the poison rows and its turn's lock.
	Consumer string
	// What names the consumer in errors, e.g. `inbox: consumer "billing"`.
	What string
	// CommitTimeout bounds what follows successful handlers: the writes and the COMMIT.
	// Default DefaultCommitTimeout.
	CommitTimeout time.Duration
	// Logger receives failed rollbacks. Default slog.Default().
	Logger *slog.Logger
}

// Check reports every problem of the settings a consumer passes on to its Runner, each saying
// what to change; the consumer's constructor adds them to its own (and says in its own words
// that a nil pool is missing).
func Check(pool *pgxpool.Pool, schema, consumer string, commitTimeout time.Duration) []error {
	var problems []error
	if n := maxConns(pool); n < 2 {
		problems = append(problems, fmt.Errorf("Pool's MaxConns is %d; a consumer holds one connection per transaction in flight and keeps one free "+
			"for handlers that use the pool themselves (else they could wait for a connection forever): set pool_max_conns (or MaxConns) to at least 2", n))
	}
	if err := pgsql.ValidateSchema(schema); err != nil {
		problems = append(problems, err)
	}
	if err := CheckConsumer(consumer); err != nil {
		problems = append(problems, err)
	}
	if commitTimeout < 0 {
		problems = append(problems, fmt.Errorf("CommitTimeout is %s; use 0 for the default (%s) or a positive bound", commitTimeout, DefaultCommitTimeout))
	}
	return problems
}

// maxConns is pool's MaxConns; 2 (enough) for a nil pool, which the caller reports itself.
func maxConns(pool *pgxpool.Pool) int32 {
	if pool == nil {
		return 2
	}
	return pool.Config().MaxConns
}

// Runner runs a consumer's units of work, one transaction each. It is safe for concurrent use.
type Runner struct {
	cfg   Config
	slots *slots
	sql   statements
}

// New returns the Runner of a consumer whose settings passed Check.
func New(cfg Config) *Runner {
	if cfg.CommitTimeout == 0 {
		cfg.CommitTimeout = DefaultCommitTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.What == "" {
		cfg.What = fmt.Sprintf("consumer %q", cfg.Consumer)
	}
	return &Runner{cfg: cfg, slots: slotsOf(cfg.Pool), sql: newStatements(cfg.Schema)}
}

// CommitTimeout is the bound of the writes and COMMIT that follow successful handlers.
func (r *Runner) CommitTimeout() time.Duration { return r.cfg.CommitTimeout }

// Unit is one consumer's part of a transaction: what to claim, what to run, what to write.
type Unit interface {
	// Apply runs in tx after BEGIN (and the consumer's turn): it claims the messages' dedup
	// keys, runs the handlers of the new ones in order, and keeps what they return. It returns
	// the indexes in the batch of the messages it applied; none means nothing to commit. A
	// handler's error goes through Blame; any other error fails the transaction as a whole.
	Apply(ctx context.Context, tx pgx.Tx) (applied []int, err error)
	// Write writes what commits with the handlers' work (outbox rows through Refused, saga
	// rows, timers). It runs once every handler succeeded, on a context detached from the
	// message's cancellation and bounded by the commit timeout, like the COMMIT after it.
	Write(ctx context.Context, tx pgx.Tx) error
}

// Starter is a Unit with a step before Apply: a replay marks its poison row and removes the
// message's dedup row, so the claim finds the key new again. Start returns false when there
// is nothing to do (the row was applied by another process meanwhile, or deleted): the
// transaction is rolled back and Run returns NotStarted. When Start ran, the transaction
// commits even if no message was new, so what Start and Write changed is kept.
type Starter interface {
	Unit
	Start(ctx context.Context, tx pgx.Tx) (bool, error)
}

// Outcome says what a Run did.
type Outcome int

const (
	// Applied: the transaction committed the messages in Result.Applied.
	Applied Outcome = iota + 1
	// Duplicate: no message was new (all had their dedup rows already). Nothing was kept,
	// except what a Starter's Start and Write changed.
	Duplicate
	// NotStarted: the Starter found nothing to do; rolled back.
	NotStarted
)

// Result is what a Run did; see Outcome.
type Result struct {
	Outcome Outcome
	// Applied are the indexes in the batch of the messages whose effects committed.
	Applied []int
}

// Run runs u in one transaction of n messages (the batch's size) and commits it: a slot of
// the pool, BEGIN, the consumer's turn when ctx asks for it (TakeTurns), u's Start when it is
// a Starter, u.Apply, then u.Write and COMMIT on the detached commit context. On an error
// nothing of the transaction is kept, and the error says whose it is: a *MessageError for a
// message (Blame, Refused, a COMMIT a message's deferred constraint refused), any other error
// for the transaction as a whole, which the caller runs again without counting an attempt.
//
// A message whose deadline passed before its transaction began (Watermill's
// middleware.Timeout, whose context Retry did not reset) fails as the message's: nothing was
// asked of the database, so the database cannot be blamed.
func (r *Runner) Run(ctx context.Context, n int, u Unit) (Result, error) {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return Result{}, &MessageError{Index: onlyIndex(n, 0), Err: fmt.Errorf("%s: the message's deadline passed before its transaction began: %w", r.cfg.What, ctx.Err())}
	}
	if err := r.slots.acquire(ctx); err != nil {
		return Result{}, fmt.Errorf("%s: wait for a connection of the pool: %w", r.cfg.What, err)
	}
	defer r.slots.release()
	tx, err := r.cfg.Pool.Begin(ctx)
	if err != nil {
		return Result{}, fmt.Errorf("%s: begin transaction: %w", r.cfg.What, err)
	}
	committed := false
	defer func() {
		if !committed {
			r.rollback(ctx, tx)
		}
	}()
	if err := r.takeTurn(ctx, tx); err != nil {
		return Result{}, err
	}
	started := false
	if s, ok := u.(Starter); ok {
		if started, err = s.Start(ctx, tx); err != nil || !started {
			return Result{Outcome: NotStarted}, err
		}
	}
	applied, err := u.Apply(ctx, tx)
	if err != nil {
		return Result{}, err
	}
	res := Result{Outcome: Applied, Applied: applied}
	if len(applied) == 0 {
		res.Outcome = Duplicate
		if !started {
			return res, nil // nothing to keep: rolled back
		}
	}
	// The handlers succeeded: cancellation (a revoked partition, a closing subscriber, a
	// handler deadline) no longer applies. Work that succeeded commits rather than be redone.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.CommitTimeout)
	defer cancel()
	if err := u.Write(cctx, tx); err != nil {
		return Result{}, err
	}
	if err := tx.Commit(cctx); err != nil {
		return Result{}, blameCommit(fmt.Errorf("%s: commit a transaction of %d messages: %w", r.cfg.What, len(applied), err), tx.Conn(), applied)
	}
	committed = true
	return res, nil
}

// InTx runs fn in a transaction of its own — a settlement: a message given up, a command
// answered as failed — with the same slot, commit timeout and rollback as Run.
func (r *Runner) InTx(ctx context.Context, fn func(ctx context.Context, tx pgx.Tx) error) error {
	if err := r.slots.acquire(ctx); err != nil {
		return fmt.Errorf("%s: wait for a connection of the pool: %w", r.cfg.What, err)
	}
	defer r.slots.release()
	tx, err := r.cfg.Pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("%s: begin transaction: %w", r.cfg.What, err)
	}
	committed := false
	defer func() {
		if !committed {
			r.rollback(ctx, tx)
		}
	}()
	if err := fn(ctx, tx); err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.CommitTimeout)
	defer cancel()
	if err := tx.Commit(cctx); err != nil {
		return fmt.Errorf("%s: commit: %w", r.cfg.What, err)
	}
	committed = true
	return nil
}

// rollback ends a transaction that did not commit, within rollbackTimeout, on a context
// detached from the message's. A failure is logged unless the connection is gone (the server
// aborted the transaction with it: pgx closes the connection when a statement's context ends).
func (r *Runner) rollback(ctx context.Context, tx pgx.Tx) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	closed := tx.Conn() != nil && tx.Conn().IsClosed()
	// Always called, even on a broken connection: it also returns the connection to the pool.
	if err := tx.Rollback(ctx); err != nil && !errors.Is(err, pgx.ErrTxClosed) && !closed {
		r.cfg.Logger.Warn("onceflow: rollback failed; the connection is discarded and the server aborts the transaction",
			"consumer", r.cfg.Consumer, "err", err)
	}
}

// Blame says whose err is — the error of the handler of the message at index (−1: a set-based
// handler that did not say which), run in tx's transaction under ctx — by the rule of
// internal/failure (failure.Whose): the message's becomes a *MessageError; the transaction's,
// or the consumer stopping, is returned as it is (no attempt is counted); nil stays nil.
func Blame(ctx context.Context, err error, conn *pgx.Conn, index int) error {
	if failure.Whose(ctx, err, conn) == failure.Message {
		return &MessageError{Index: index, Err: err}
	}
	return err
}

// blameCommit says whose a failed COMMIT of the messages applied is. Its outcome can be
// unknown (the connection lost after sending it); failing is safe either way: if it did
// commit, the redelivery finds the dedup rows and is skipped. A failure of the transaction's
// connection or server (the commit timeout included) is the transaction's; anything else is a
// constraint a handler deferred to COMMIT: the message's when there was one, else no single
// message can be named (−1: the consumer splits the batch to find it).
func blameCommit(err error, conn *pgx.Conn, applied []int) error {
	if failure.OfTransaction(err, conn) {
		return err
	}
	only := -1
	if len(applied) == 1 {
		only = applied[0]
	}
	return &MessageError{Index: only, Err: err}
}

func onlyIndex(n, i int) int {
	if n == 1 {
		return i
	}
	return -1
}

// Refused maps the outbox's refusal of the i-th message of a write (too large, no topic, not a
// UUID: an error with a MessageIndex method, *outbox.ValidationError) to the message of the
// batch whose handler returned it, origin[i]: retrying the batch cannot fix it, so the
// consumer isolates that message. A refusal that names no message of origin (a set-based
// handler's messages: origin is nil) is a *MessageError of index −1: the consumer splits the
// batch to find it. Any other error is returned as it is.
func Refused(err error, origin []int) error {
	var refusal interface{ MessageIndex() int }
	if !errors.As(err, &refusal) {
		return err
	}
	if i := refusal.MessageIndex(); i >= 0 && i < len(origin) {
		return &MessageError{Index: origin[i], Err: err}
	}
	return &MessageError{Index: -1, Err: err}
}

type turnsKey struct{}

// TakeTurns returns a context in which the consumers' transactions take turns: each first
// takes a transaction-level advisory lock on its consumer's name, so the transactions of one
// consumer — across partitions and across processes — run one at a time. The batched consumer
// uses it for a while after two of its transactions conflicted over hot rows: one batch of hot
// rows at a time is cheap, while two racing ones deadlock, which PostgreSQL detects only after
// deadlock_timeout (1 s).
func TakeTurns(ctx context.Context) context.Context { return context.WithValue(ctx, turnsKey{}, true) }

// takeTurn waits, in tx, for the consumer's turn when ctx asks for it (TakeTurns); the lock is
// released when tx ends.
func (r *Runner) takeTurn(ctx context.Context, tx pgx.Tx) error {
	if on, _ := ctx.Value(turnsKey{}).(bool); !on {
		return nil
	}
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended($1, 0))`, "onceflow turns: "+r.cfg.Consumer); err != nil {
		return fmt.Errorf("%s: wait for its turn: %w", r.cfg.What, err)
	}
	return nil
}
