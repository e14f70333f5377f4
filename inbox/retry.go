package inbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/failure"
	"github.com/onceflow/onceflow/migrations"
)

// Blame says whose a failure in a batch's transaction is, the way every BatchProcessor must:
// err is returned as it is — the batch's: the consumer runs the batch again without counting
// an attempt against any message — when it is transient (the database unreachable or
// restarting, a deadlock or serialization failure, a lock or statement timeout) or when conn,
// the transaction's connection, was lost; otherwise it is the message's at index, as a
// *MessageError (index −1 when no single message can be named, e.g. a deferred constraint
// violated at COMMIT: the consumer then splits the batch to find it).
func Blame(err error, conn *pgx.Conn, index int) error {
	if err == nil || failure.OfBatch(err, conn) {
		return err
	}
	return &MessageError{Index: index, Err: err}
}

// BlameCommit is Blame for a failed COMMIT of a transaction that applied n messages, the
// i-th at index(i). The outcome of a failed COMMIT can be unknown (the connection lost after
// sending it); failing is safe either way: if it did commit, the redelivery finds the dedup
// rows and is skipped. A constraint a handler deferred to COMMIT is the message's when there
// was one, else no single message can be named (−1: the consumer splits the batch to find it).
func BlameCommit(err error, conn *pgx.Conn, n int, index func(i int) int) error {
	only := -1
	if n == 1 {
		only = index(0)
	}
	return Blame(err, conn, only)
}

type turnsKey struct{}

// TakeTurns returns a context in which the consumers' engines (the inbox's, the saga
// orchestrator's and participants') take turns: each transaction first takes a
// transaction-level advisory lock on its consumer's name (TakeTurnTx), so the transactions of
// one consumer — across partitions and across processes — run one at a time. The batched
// consumer uses it for a while after two of its transactions conflicted over hot rows: one
// batch of hot rows at a time is cheap, while two racing ones deadlock, which PostgreSQL
// detects only after deadlock_timeout (1 s).
func TakeTurns(ctx context.Context) context.Context { return context.WithValue(ctx, turnsKey{}, true) }

// TakeTurnTx waits, in tx, for the turn of consumer when ctx asks for it (TakeTurns), and does
// nothing otherwise. The lock is released when tx ends.
func TakeTurnTx(ctx context.Context, tx pgx.Tx, consumer string) error {
	if on, _ := ctx.Value(turnsKey{}).(bool); !on {
		return nil
	}
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended($1, 0))`, "onceflow turns: "+consumer); err != nil {
		return fmt.Errorf("inbox: consumer %q: wait for its turn: %w", consumer, err)
	}
	return nil
}

// RetryPolicy is how a failing message is tried again before it is given up; the batched
// consumer (inboxkafka.BatchConfig) and the saga's per-message handlers (Orchestrator.Handler,
// saga.Action and Compensation) apply the same one.
type RetryPolicy struct {
	// MaxAttempts is how often a message whose handler fails is tried before it is given up
	// with the processor's SettlePoison. Messages no retry can fix (IsPoison) are given up at
	// once.
	MaxAttempts int
	// Backoff is the wait before a failing message's second attempt, doubled per attempt up to
	// MaxBackoff, which also caps the wait between retries of a transaction the database
	// refused as a whole.
	Backoff, MaxBackoff time.Duration
	// Logger receives each failed attempt (warn) and refused transactions (error, the first and
	// then every 10th).
	Logger *slog.Logger

	// replaying marks the policy of a replay (applyReplays): what waits meanwhile is the next
	// replay, not the message's partition.
	replaying bool
}

// ApplyOne applies msg alone through p until it is processed or given up. failed, when not nil,
// is the error of an attempt already made (in a batch); source names the message in logs and
// in its poison row ("topic/partition@offset").
//
// A *MessageError counts an attempt: after MaxAttempts (at once for IsPoison) the message is
// settled with p.SettlePoison. Any other error is the transaction's (see Blame) and counts no
// attempt: a conflict with a concurrent transaction (deadlock, serialization failure, lock
// timeout) is retried at once the first time, everything else after the backoff. It returns
// nil once msg is settled, ctx.Err() when ctx ended first, and an error matching
// migrations.ErrNotMigrated at once (no retry can help until the schema is migrated).
func (rp RetryPolicy) ApplyOne(ctx context.Context, p BatchProcessor, msg *message.Message, source string, failed error) error {
	attempts, refused := 0, 0
	if failed != nil {
		attempts = 1
	}
	for err := failed; ; {
		if err != nil {
			if IsPoison(err) || attempts >= rp.MaxAttempts {
				return rp.giveUp(ctx, p, msg, Poison{Source: source, Attempts: attempts, Err: err})
			}
			waits := "later messages of its partition wait"
			if rp.replaying {
				waits = "the next replay waits"
			}
			rp.Logger.Warn("inbox: message failed; trying it again alone ("+waits+")",
				"source", source, "message_uuid", msg.UUID, "attempt", attempts, "max_attempts", rp.MaxAttempts, "err", err)
			if !failure.Sleep(ctx, failure.Backoff(rp.Backoff, rp.MaxBackoff, attempts)) {
				return ctx.Err()
			}
		}
		perr := p.ProcessBatch(ctx, []*message.Message{msg})
		var me *MessageError
		switch {
		case perr == nil:
			return nil
		case ctx.Err() != nil:
			return ctx.Err()
		case errors.As(perr, &me):
			attempts++
			err = me.Err
			continue
		case errors.Is(perr, migrations.ErrNotMigrated):
			return perr // no retry helps until someone migrates: say so now
		}
		err = nil
		if !rp.Refused(ctx, refused, 1, source, perr) {
			return ctx.Err()
		}
		refused++
	}
}

// Refused handles the refusal of a transaction of n messages as a whole (failures before it:
// how many times in a row): it logs the first and every 10th, so an outage logs a few lines
// rather than thousands, and waits before the retry — not at all after a first conflict with
// a concurrent transaction, which a second run usually gets past. It reports false when ctx
// ended first.
func (rp RetryPolicy) Refused(ctx context.Context, failures, n int, source string, err error) bool {
	switch {
	case failures%10 != 0:
	case failure.Contention(err):
		// Expected with hot rows; an error only if it keeps happening.
		level := slog.LevelWarn
		if failures > 0 {
			level = slog.LevelError
		}
		rp.Logger.Log(ctx, level, "inbox: a transaction conflicted with a concurrent one over the same rows (hot rows: docs/inbox.md, \"Hot rows\"); retrying it (its messages wait, none is skipped, no attempt is counted)",
			"messages", n, "source", source, "failures", failures+1, "err", err)
	default:
		rp.Logger.Error("inbox: a transaction could not be applied; retrying it (its messages wait, none is skipped, no attempt is counted)",
			"messages", n, "source", source, "failures", failures+1, "err", err)
	}
	if failures == 0 && failure.Contention(err) {
		return ctx.Err() == nil
	}
	return failure.Sleep(ctx, failure.Backoff(rp.Backoff, rp.MaxBackoff, failures+1))
}

// giveUp settles msg as poison, retrying until the database takes it or ctx ends.
func (rp RetryPolicy) giveUp(ctx context.Context, p BatchProcessor, msg *message.Message, ps Poison) error {
	for failures := 0; ; failures++ {
		err := p.SettlePoison(ctx, msg, ps)
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if !rp.Refused(ctx, failures, 1, ps.Source, fmt.Errorf("record poison message: %w", err)) {
			return ctx.Err()
		}
	}
}
