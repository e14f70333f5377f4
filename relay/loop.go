package relay

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
)

// loop is the publishing loop: one batch at a time, in id order.
func (r *Relay) loop(ctx context.Context) {
	poll := time.NewTimer(r.cfg.PollInterval)
	defer poll.Stop()
	for ctx.Err() == nil {
		if shards, epochs := r.leases.takeReleases(); len(shards) > 0 {
			if err := r.leases.giveBack(ctx, shards, epochs); err != nil && ctx.Err() == nil {
				r.m.Failed(FailureDatabase, 1)
				r.log.Warn("relay could not release shards; they expire on their own", "err", err)
			}
		}
		wait, next := r.step(ctx)
		switch next {
		case claimAgain:
			continue
		case backOff:
			// Something failed for everyone (broker or database): wait it out, ignoring
			// notifications, which would only hit the same failure sooner.
			poll.Reset(wait)
			select {
			case <-ctx.Done():
			case <-poll.C:
			}
			continue
		}
		if wait <= 0 || wait > r.cfg.PollInterval {
			wait = r.cfg.PollInterval
		}
		poll.Reset(wait)
		select {
		case <-ctx.Done():
		case <-r.wake:
		case <-r.leases.changed:
		case <-poll.C:
		}
		if !poll.Stop() {
			select {
			case <-poll.C:
			default:
			}
		}
	}
}

// What the loop does after a step.
type nextStep int

const (
	claimAgain nextStep = iota // the batch was full and made progress: claim the next one now
	idle                       // wait for a notification, a lease change, a blocked key's retry or the poll
	backOff                    // a global failure: wait the whole backoff
)

// step claims and publishes one batch and says what the loop does next, and for how long at
// most it waits.
func (r *Relay) step(ctx context.Context) (wait time.Duration, next nextStep) {
	snap, bctx, done, ok := r.leases.begin(context.WithoutCancel(ctx))
	if !ok {
		return r.cfg.PollInterval, idle
	}
	defer done()
	// On shutdown the batch in flight gets ShutdownTimeout to finish; lease loss cancels it at
	// once (through bctx).
	stop := context.AfterFunc(ctx, func() { time.AfterFunc(r.cfg.ShutdownTimeout, done) })
	defer stop()

	now := time.Now()
	keys, ids, retryAt := r.blocked.filter(now)
	sql, args := r.q.claimSQL(snap, r.cfg.Shards, keys, ids, r.cfg.BatchSize)
	t0 := time.Now()
	msgs, err := r.claim(bctx, sql, args)
	tClaim := time.Since(t0)
	if err != nil {
		if bctx.Err() != nil {
			return r.cfg.PollInterval, idle // lease lost or shutting down, not a database failure
		}
		r.m.Failed(FailureDatabase, 1)
		r.log.Warn("relay claim failed; retrying", "err", err)
		return r.globalBackoff(), backOff
	}
	if !retryAt.IsZero() {
		wait = retryAt.Sub(now)
	}
	if len(msgs) == 0 {
		r.idleFails = 0
		return wait, idle
	}
	t1 := time.Now()
	res := r.publish(bctx, msgs)
	t2 := time.Now()
	r.finish(ctx, snap, msgs, res)
	if r.log.Enabled(ctx, slog.LevelDebug) {
		r.log.Debug("relay batch", "rows", len(msgs), "acked", len(res.ackedIDs), "failed", len(res.culprits)+res.transient,
			"claim", tClaim, "publish", t2.Sub(t1), "finish", time.Since(t2))
	}
	if len(res.ackedIDs) == 0 && len(res.parkedIDs) == 0 && res.transient > 0 {
		return r.globalBackoff(), backOff
	}
	r.idleFails = 0
	if len(msgs) == r.cfg.BatchSize {
		return 0, claimAgain
	}
	return wait, idle
}

func (r *Relay) globalBackoff() time.Duration {
	r.idleFails++
	return backoffDelay(r.cfg.RetryBackoff, r.cfg.MaxRetryBackoff, r.idleFails, rand.Float64())
}

func (r *Relay) claim(ctx context.Context, sql string, args []any) ([]*Message, error) {
	rows, err := r.pool.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	msgs := make([]*Message, 0, r.cfg.BatchSize)
	for rows.Next() {
		m := &Message{}
		var meta []byte
		if err = rows.Scan(&m.ID, &m.EventID, &m.Topic, &m.Key, &m.keyHash, &m.Payload, &meta, &m.CreatedAt, &m.Attempts); err != nil {
			return nil, err
		}
		m.blockKey = blockKeyOf(m.Key, m.ID)
		if m.Metadata, err = parseMetadata(meta); err != nil {
			// Not a JSON object of strings (the writer never stores that): refuse this row only.
			m.Metadata = nil
			m.badMetadata = fmt.Errorf("metadata of row %d is not a JSON object of strings: %w", m.ID, err)
		}
		msgs = append(msgs, m)
	}
	return msgs, rows.Err()
}

// finish records the batch's outcome in the database: acknowledged rows deleted, undeliverable
// failures counted and parked at the limit. It uses its own context: deleting acknowledged
// rows is worth finishing even when shutdown or a lost lease cancelled the batch.
func (r *Relay) finish(ctx context.Context, snap snapshot, msgs []*Message, res *result) {
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	now := time.Now()
	// Deleted before the next claim, never overlapped with it: a claim that skipped rows still
	// being deleted by an id range would also skip a row of the same key committed late inside
	// that range while taking the key's later rows, and reorder the key.
	if len(res.ackedIDs) > 0 {
		if err := r.deleteAcked(fctx, res.ackedIDs); err != nil {
			r.m.Failed(FailureDatabase, 1)
			r.log.Warn("relay could not delete acknowledged rows; they will be published again (same event ids)", "rows", len(res.ackedIDs), "err", err)
		}
	}
	for _, m := range res.ackedMsgs {
		r.blocked.ok(m)
	}
	if len(res.culprits) > 0 {
		r.recordFailures(fctx, snap, res, now)
	}
	for _, m := range res.transientMsgs {
		r.blocked.fail(m, 0, now)
	}
}

// deleteAcked deletes acknowledged rows in one round trip. The commit does not wait for the
// WAL flush (synchronous_commit off for this transaction only): if the server crashes before
// the flush, the rows come back and are published again with the same event ids, which the
// contract allows, and every batch saves a disk flush.
func (r *Relay) deleteAcked(ctx context.Context, ids []int64) error {
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	b.Queue("SET LOCAL synchronous_commit TO OFF")
	b.Queue(r.q.deleteAcked, ids)
	b.Queue("COMMIT")
	return r.pool.SendBatch(ctx, b).Close()
}

// recordFailures counts undeliverable failures in outbox.attempts and parks rows that reached the
// limit, both only while this relay still holds the row's shard at the snapshot's epoch.
func (r *Relay) recordFailures(ctx context.Context, snap snapshot, res *result, now time.Time) {
	culprits := res.culprits
	var countIDs, parkIDs []int64
	var countErrs, parkErrs []string
	for _, c := range culprits {
		if c.msg.Attempts+1 >= r.cfg.MaxAttempts {
			parkIDs = append(parkIDs, c.msg.ID)
			parkErrs = append(parkErrs, errString(c.err))
		} else {
			countIDs = append(countIDs, c.msg.ID)
			countErrs = append(countErrs, errString(c.err))
		}
	}
	var parked []int64
	err := pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
		if len(countIDs) > 0 {
			if _, err := tx.Exec(ctx, r.q.countFailure, countIDs, r.cfg.Shards, r.cfg.InstanceID, snap.epochs, countErrs); err != nil {
				return fmt.Errorf("count failed attempts: %w", err)
			}
		}
		if len(parkIDs) > 0 {
			rows, err := tx.Query(ctx, r.q.park, parkIDs, r.cfg.Shards, r.cfg.InstanceID, snap.epochs, parkErrs)
			if err != nil {
				return fmt.Errorf("park rows: %w", err)
			}
			parked, err = pgx.CollectRows(rows, pgx.RowTo[int64])
			if err != nil {
				return fmt.Errorf("park rows: %w", err)
			}
		}
		return nil
	})
	if err != nil {
		r.m.Failed(FailureDatabase, 1)
		r.log.Warn("relay could not record failed attempts; the rows are retried", "err", err)
		parked = nil
	}
	isParked := map[int64]bool{}
	for _, id := range parked {
		isParked[id] = true
	}
	for _, c := range culprits {
		if isParked[c.msg.ID] {
			// The chain moves on without it: later rows of the key are no longer held.
			r.blocked.ok(c.msg)
			r.log.Error("relay parked a row the broker keeps refusing; later rows of its key now flow (its order is broken by design); inspect with `onceflow outbox parked`, replay with `onceflow outbox replay`",
				"id", c.msg.ID, "event_id", c.msg.EventID, "topic", c.msg.Topic, "key", c.msg.Key, "attempts", c.msg.Attempts+1, "err", c.err)
			continue
		}
		d := r.blocked.fail(c.msg, c.msg.Attempts+1, now)
		r.log.Warn("relay: broker refused a row; its key waits and retries",
			"id", c.msg.ID, "event_id", c.msg.EventID, "topic", c.msg.Topic, "key", c.msg.Key,
			"attempt", c.msg.Attempts+1, "max_attempts", r.cfg.MaxAttempts, "retry_in", d.Round(time.Millisecond), "err", c.err)
	}
	if len(parked) > 0 {
		r.m.Parked(len(parked))
	}
	res.parkedIDs = parked
}

// errString shortens an error for the last_error column and logs.
func errString(err error) string {
	s := err.Error()
	const limit = 2000
	if len(s) > limit {
		s = s[:limit] + "…"
	}
	return s
}
