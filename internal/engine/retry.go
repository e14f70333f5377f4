package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/internal/failure"
	"github.com/onceflow/onceflow/internal/pgsql"
)

// The retry defaults of every consumer: the batched consumer (inboxkafka.BatchConfig), the
// saga orchestrator and participants (their MaxAttempts), and replays.
const (
	// DefaultMaxAttempts is how often a failing message is tried before it is given up.
	DefaultMaxAttempts = 5
	// DefaultBackoff is the wait before a failing message's second attempt; it doubles per
	// attempt up to DefaultMaxBackoff.
	DefaultBackoff = 100 * time.Millisecond
	// DefaultMaxBackoff caps the wait between attempts, and between retries of a transaction
	// the database refused as a whole.
	DefaultMaxBackoff = 5 * time.Second
)

// RetryPolicy is how a failing message is tried again before it is given up. Every consumer
// applies the same one. Its zero value is usable: a zero field takes its default.
type RetryPolicy struct {
	// MaxAttempts is how often a message whose handler fails is tried before it is given up
	// with the processor's SettlePoison. Messages no retry can fix (Unfixable) are given up at
	// once. Default DefaultMaxAttempts.
	MaxAttempts int
	// Backoff is the wait before a failing message's second attempt, doubled per attempt up to
	// MaxBackoff, which also caps the wait between retries of a transaction the database
	// refused as a whole. Defaults DefaultBackoff and DefaultMaxBackoff.
	Backoff, MaxBackoff time.Duration
	// Logger receives each failed attempt (warn) and refused transactions (error, the first
	// and then every 10th). Default slog.Default().
	Logger *slog.Logger
	// Replaying marks the policy of a replay: what waits meanwhile is the next replay, not
	// the message's partition.
	Replaying bool
}

// NewRetryPolicy is the one way consumers build their policy: zero arguments take the defaults.
func NewRetryPolicy(maxAttempts int, backoff, maxBackoff time.Duration, log *slog.Logger) RetryPolicy {
	return RetryPolicy{MaxAttempts: maxAttempts, Backoff: backoff, MaxBackoff: maxBackoff, Logger: log}.withDefaults()
}

func (rp RetryPolicy) withDefaults() RetryPolicy {
	if rp.MaxAttempts <= 0 {
		rp.MaxAttempts = DefaultMaxAttempts
	}
	if rp.Backoff <= 0 {
		rp.Backoff = DefaultBackoff
	}
	if rp.MaxBackoff <= 0 {
		rp.MaxBackoff = max(DefaultMaxBackoff, rp.Backoff)
	}
	if rp.Logger == nil {
		rp.Logger = slog.Default()
	}
	return rp
}

// ApplyOne applies msg alone through p until it is processed or given up. failed, when not
// nil, is the error of an attempt already made (in a batch); source names the message in logs
// and in its poison row ("topic/partition@offset").
//
// A *MessageError counts an attempt: after MaxAttempts (at once for Poison) the message is
// settled with p.SettlePoison. One whose error is a *RetryLater is parked at once when p is a
// Parker (its retry lane), and counted as an ordinary failure otherwise. Any other error is the transaction's (see Blame) and counts no
// attempt: a conflict with a concurrent transaction (deadlock, serialization failure, lock
// timeout) is retried at once the first time, everything else after the backoff. It returns
// nil once msg is settled, ctx.Err() when ctx ended first, and an error matching
// migrations.ErrNotMigrated at once (no retry can help until the schema is migrated).
func (rp RetryPolicy) ApplyOne(ctx context.Context, p BatchProcessor, msg *message.Message, source string, failed error) error {
	rp = rp.withDefaults()
	attempts, refused := 0, 0
	if failed != nil {
		attempts = 1
	}
	for err := failed; ; {
		if err != nil {
			if rl := AsRetryLater(err); rl != nil {
				// The handler asked for later: park it, so its partition moves on. A processor
				// without a lane counts it as an ordinary failure.
				parked, perr := rp.park(ctx, p, msg, Later{Source: source, Attempts: attempts, Err: err, After: rl.After})
				if parked || perr != nil {
					return perr
				}
			}
			if Unfixable(err) || attempts >= rp.MaxAttempts {
				return rp.giveUp(ctx, p, msg, GiveUp{Source: source, Attempts: attempts, Err: err})
			}
			waits := "later messages of its partition wait"
			if rp.Replaying {
				waits = "the next replay waits"
			}
			rp.Logger.Warn("onceflow: message failed; trying it again alone ("+waits+")",
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
		case errors.Is(perr, pgsql.ErrNotMigrated):
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
	rp = rp.withDefaults()
	switch {
	case failures%10 != 0:
	case failure.Contention(err):
		// Expected with hot rows; an error only if it keeps happening.
		level := slog.LevelWarn
		if failures > 0 {
			level = slog.LevelError
		}
		rp.Logger.Log(ctx, level, "onceflow: a transaction conflicted with a concurrent one over the same rows (hot rows: docs/inbox.md, \"Hot rows\"); retrying it (its messages wait, none is skipped, no attempt is counted)",
			"messages", n, "source", source, "failures", failures+1, "err", err)
	default:
		rp.Logger.Error("onceflow: a transaction could not be applied; retrying it (its messages wait, none is skipped, no attempt is counted)",
			"messages", n, "source", source, "failures", failures+1, "err", err)
	}
	if failures == 0 && failure.Contention(err) {
		return ctx.Err() == nil
	}
	return failure.Sleep(ctx, failure.Backoff(rp.Backoff, rp.MaxBackoff, failures+1))
}

// giveUp settles msg as poison, retrying until the database takes it or ctx ends.
func (rp RetryPolicy) giveUp(ctx context.Context, p BatchProcessor, msg *message.Message, g GiveUp) error {
	for failures := 0; ; failures++ {
		err := p.SettlePoison(ctx, msg, g)
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if !rp.Refused(ctx, failures, 1, g.Source, fmt.Errorf("record poison message: %w", err)) {
			return ctx.Err()
		}
	}
}

// Unfixable reports whether err is one that retrying the same message cannot fix, so the
// message is given up at once: no usable dedup key (ErrNoKey), or a message it returned that
// the outbox refuses (an error with a MessageIndex method: *outbox.ValidationError).
func Unfixable(err error) bool {
	var refusal interface{ MessageIndex() int }
	return errors.Is(err, ErrNoKey) || errors.As(err, &refusal)
}

// Replayer is a BatchProcessor that applies the replay requests of its consumer's poison rows
// (inbox.Admin.ReplayTx). inboxkafka.BatchConsumer runs ApplyReplays every ReplayInterval while it
// runs; the processors of inbox.Inbox.Batch, BatchNoPublish and BatchFunc are Replayers. The
// saga orchestrator and participants are not: their poison rows are refused (see ReplayTx).
type Replayer interface {
	// ApplyReplays applies the waiting requests of the rows given up by a batched consumer of
	// topics (a replay runs only in the consumer that gave the message up), each with rp's
	// attempts and backoff, and returns how many were replayed. It returns early only when
	// ctx ends or the schema is not migrated.
	ApplyReplays(ctx context.Context, rp RetryPolicy, topics []string) (int, error)
	// ReplayInterval is how often to call ApplyReplays (inbox.Config.ReplayInterval).
	ReplayInterval() time.Duration
}

// RunReplays calls apply at once and then every interval until ctx ends, logging its errors
// (the first and every 10th in a row): the loop of a consumer that applies replay requests
// (inbox.Inbox.RouterPlugin; inboxkafka.BatchConsumer with a Replayer).
func RunReplays(ctx context.Context, interval time.Duration, log *slog.Logger, apply func(context.Context) (int, error)) {
	RunEvery(ctx, "applying replay requests", interval, log, apply)
}

// RunEvery is RunReplays for any periodic work of a consumer (what names it in the log): the
// retry lane's drain, the replays.
func RunEvery(ctx context.Context, what string, interval time.Duration, log *slog.Logger, apply func(context.Context) (int, error)) {
	failures := 0
	for {
		_, err := apply(ctx)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			if failures%10 == 0 {
				log.Error("onceflow: "+what+" failed; trying again", "failures", failures+1, "err", err)
			}
			failures++
		} else {
			failures = 0
		}
		if !failure.Sleep(ctx, interval) {
			return
		}
	}
}
