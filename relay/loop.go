package relay

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
)

// Sleep and wake-up timing (see Config.BusyPollInterval and docs/relay.md).
const (
	// idleAfter is how long without rows before the relay goes to sleep.
	idleAfter = 25 * time.Millisecond
	// sleepGrace is how long a relay that just went to sleep keeps polling tightly: writers
	// trust a relay to be awake for up to outbox.WakeCheckInterval after they last looked, and
	// do not notify meanwhile.
	sleepGrace = 2 * outbox.WakeCheckInterval
)

// loop is the publishing loop: one batch at a time.
func (r *Relay) loop(ctx context.Context) {
	poll := time.NewTimer(r.cfg.PollInterval)
	defer poll.Stop()
	r.lastRows, r.backoff = time.Now(), r.cfg.BusyPollInterval
	for ctx.Err() == nil {
		if shards, epochs := r.leases.takeReleases(); len(shards) > 0 {
			r.flushPending(ctx) // their new owner would publish them again
			if err := r.leases.giveBack(ctx, shards, epochs); err != nil && ctx.Err() == nil {
				r.m.Failed(FailureDatabase, 1)
				r.log.Warn("relay could not release shards; they expire on their own", "err", err)
			}
		}
		out := r.step(ctx)
		if out.rows > 0 {
			r.lastRows, r.backoff = time.Now(), r.cfg.BusyPollInterval
		}
		var wait time.Duration
		switch out.next {
		case claimAgain:
			continue
		case backOff:
			// Something failed for everyone (broker or database): wait it out, ignoring
			// notifications, which would only hit the same failure sooner.
			r.flushPending(ctx)
			poll.Reset(out.wait)
			select {
			case <-ctx.Done():
			case <-poll.C:
			}
			continue
		case noShards:
			r.flushPending(ctx)
			if r.asleep {
				r.setAwake(ctx) // nothing to publish: writers need not wake this relay
			}
			wait = r.cfg.PollInterval
		default:
			wait = r.idleWait(ctx, out)
			if wait > r.cfg.BusyPollInterval {
				r.flushPending(ctx) // no claim comes soon to take the delete along
			}
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
	r.flushPending(ctx)
}

// idleWait decides how long the loop waits after a batch that was not full, moving between
// polling and sleeping: every BusyPollInterval while rows keep coming; after idleAfter
// without rows the relay marks itself asleep (writers then notify it on commit), keeps polling
// tightly for sleepGrace, then backs off to PollInterval.
func (r *Relay) idleWait(ctx context.Context, out stepOutcome) time.Duration {
	now := time.Now()
	wait := r.cfg.BusyPollInterval
	switch {
	case out.rows > 0: // rows keep coming: poll again soon
	case now.Sub(r.lastRows) >= idleAfter:
		if !r.asleep && r.listening.Load() {
			r.setAsleep(ctx)
		}
		if !r.asleep || now.Sub(r.sleptAt) >= sleepGrace {
			// Asleep (woken by NOTIFY), or unable to be woken (no listener): poll less and less,
			// quickly reaching PollInterval (a few polls still catch a transaction that wrote
			// before the mark and commits late, without a notification).
			r.backoff = min(4*r.backoff, r.cfg.PollInterval)
			wait = r.backoff
		}
	}
	if !out.retryAt.IsZero() {
		wait = max(0, min(wait, out.retryAt.Sub(now)))
	}
	return wait
}

// setAsleep marks the relay asleep in relay_member, so writers notify it on commit.
func (r *Relay) setAsleep(ctx context.Context) {
	n, err := r.execAsync(ctx, r.q.sleep, r.cfg.InstanceID, r.cfg.LeaseDuration.Seconds())
	if err != nil || n != 1 {
		if err != nil && ctx.Err() == nil {
			r.log.Debug("relay could not mark itself asleep; polling instead", "err", err)
		}
		return // stay awake: polling finds the rows, only later
	}
	r.asleep, r.sleptAt = true, time.Now()
	r.asleepSince.Store(r.sleptAt.UnixNano())
}

// setAwake clears the mark, so writers stop notifying.
func (r *Relay) setAwake(ctx context.Context) {
	r.clearMark(ctx)
	r.asleep = false
	r.asleepSince.Store(0)
}

// setAwakeAsync clears the mark like setAwake, on a goroutine of its own; the relay counts
// as awake from now on. The returned function waits until the statement finished.
func (r *Relay) setAwakeAsync(ctx context.Context) (wait func()) {
	r.asleep = false
	r.asleepSince.Store(0)
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.clearMark(ctx)
	}()
	return func() { <-done }
}

func (r *Relay) clearMark(ctx context.Context) {
	if _, err := r.execAsync(ctx, r.q.wake, r.cfg.InstanceID); err != nil && ctx.Err() == nil {
		// Writers keep notifying until it expires with the heartbeat: slower commits, no harm.
		r.log.Debug("relay could not clear its asleep mark", "err", err)
	}
}

// execAsync runs one statement in a transaction that does not wait for the WAL flush (the
// asleep mark is a hint: losing it in a crash costs nothing), in one round trip.
func (r *Relay) execAsync(ctx context.Context, sql string, args ...any) (int64, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	b.Queue("SET LOCAL synchronous_commit TO OFF")
	b.Queue(sql, args...)
	b.Queue("COMMIT")
	br := r.pool.SendBatch(ctx, b)
	defer func() { _ = br.Close() }() // closed explicitly below on success
	var n int64
	for i := range 4 {
		tag, err := br.Exec()
		if err != nil {
			return 0, err
		}
		if i == 2 {
			n = tag.RowsAffected()
		}
	}
	return n, br.Close()
}

// What the loop does after a step.
type nextStep int

const (
	claimAgain nextStep = iota // more rows may be waiting (batch full or cut by the byte budget): claim now
	idle                       // wait for a notification, a lease change, a blocked key's retry or the poll
	backOff                    // a global failure: wait the whole backoff
	noShards                   // the relay holds no shard
)

// stepOutcome is what one step reports to the loop.
type stepOutcome struct {
	next    nextStep
	wait    time.Duration // backOff: how long
	rows    int           // rows claimed
	retryAt time.Time     // when the earliest blocked chain may be retried (zero: none waits)
}

// step claims and publishes one batch and says what the loop does next.
func (r *Relay) step(ctx context.Context) stepOutcome {
	snap, bctx, done, ok := r.leases.begin(context.WithoutCancel(ctx))
	if !ok {
		return stepOutcome{next: noShards}
	}
	defer done()
	// On shutdown the batch in flight gets ShutdownTimeout to finish; lease loss cancels it at
	// once (through bctx).
	stop := context.AfterFunc(ctx, func() { time.AfterFunc(r.cfg.ShutdownTimeout, done) })
	defer stop()

	if snap.gen != r.cur.gen {
		// Shards were acquired: their rows below the cursor were never looked at. The floors of
		// the blocked chains go back to the start too: while a chain's shard was away, retry
		// claims (which only read owned shards) saw none of its rows and moved its floor past
		// rows that are still pending; kept, that floor would let the chain's later rows go
		// out before them once the shard is back.
		r.cur = cursor{gen: snap.gen}
		r.blocked.lowerFloors(0)
	}
	now := time.Now()
	blocked := r.blocked.plan(now)
	kind := claimNext
	var c *claimed
	var tClaim time.Duration // how long this step waited for its claim
	t0 := time.Now()
	p := r.takePrefetch()
	prefetched := p != nil && p.usable(r.cur, snap, r.blocked)
	if prefetched {
		c, tClaim = p.c, time.Since(t0)
		r.retriedLast = false
	} else {
		if blocked.anyDue() && !r.retriedLast {
			kind = claimRetry
		}
		r.retriedLast = kind == claimRetry
		var sql string
		var args []any
		if kind == claimRetry {
			sql, args = r.q.retrySQL(snap, r.cfg.Shards, r.cur, blocked, r.cfg.BatchSize, r.cfg.MaxBatchBytes)
		} else {
			sql, args = r.q.nextSQL(snap, r.cfg.Shards, r.cur, blocked, r.cfg.BatchSize, r.cfg.MaxBatchBytes)
		}
		t0 = time.Now()
		cctx, cancelClaim := context.WithTimeout(bctx, r.cfg.StatementTimeout)
		var deleted bool
		var err error
		c, deleted, err = r.runClaim(cctx, kind, sql, args, r.cfg.BatchSize, r.pending)
		cancelClaim()
		tClaim = time.Since(t0)
		if deleted {
			r.pending = pendingDelete{}
		}
		if err != nil {
			r.flushPending(ctx) // the claim failed before its delete was confirmed: delete on its own
			if bctx.Err() != nil {
				return stepOutcome{next: idle, retryAt: blocked.next} // lease lost or shutting down, not a database failure
			}
			r.m.Failed(FailureDatabase, 1)
			r.log.Warn("relay claim failed; retrying", "err", err)
			return stepOutcome{next: backOff, wait: r.globalBackoff()}
		}
	}
	if changed, why := r.serverChanged(c); changed {
		// Nothing of this claim is published: it ran from a cursor that means nothing here.
		r.log.Warn("relay is on another PostgreSQL server than its last claim (failover, or a restart that lost its last commits); it reads the outbox again from the start: rows it had published and deleted on the old server may be published again, with their event ids",
			"why", why)
		r.cur = cursor{gen: snap.gen}
		r.blocked.lowerFloors(0)
		r.pending = pendingDelete{} // ran guarded by the old server (deleteAcked): deleted nothing here
		return stepOutcome{next: claimAgain}
	}
	res := &result{}
	if len(c.msgs) > 0 {
		if r.asleep {
			// Woken: clear the mark now, not after the batch. The publish may wait up to the
			// sink's delivery timeout (a stalled broker), and while the mark stands every
			// outbox commit sends a NOTIFY and queues on PostgreSQL's commit-time notify
			// lock. The statement runs on another connection while the batch is published,
			// so waking adds no round trip to the first batch's latency.
			woke := r.setAwakeAsync(ctx)
			defer woke()
		}
		if kind == claimNext && !c.exhausted() && len(r.blocked.entries) == 0 && c.bytes <= r.cfg.MaxBatchBytes/2 && ctx.Err() == nil {
			// More rows wait (the loop claims again at once): claim them while this batch is
			// published, within the rest of the byte budget. A batch of large rows that took
			// most of the budget is followed by a claim of its own, as it was before: the two
			// batches held at once never exceed MaxBatchBytes.
			r.startPrefetch(ctx, snap, c)
		}
		t1 := time.Now()
		res = r.publish(bctx, c.msgs)
		t2 := time.Now()
		r.finish(ctx, snap, c.msgs, res)
		if r.log.Enabled(ctx, slog.LevelDebug) {
			r.log.Debug("relay batch", "kind", kind, "prefetched", prefetched, "rows", len(c.msgs), "bytes", c.bytes, "acked", len(res.ackedIDs),
				"failed", len(res.culprits)+res.transient, "claim", tClaim, "publish", t2.Sub(t1), "finish", time.Since(t2))
		}
	}
	r.advance(c, res, blocked, time.Now())
	r.flog.tick(len(res.culprits)+res.transient == 0, len(r.blocked.entries), time.Now())
	out := stepOutcome{next: idle, rows: len(c.msgs), retryAt: r.blocked.plan(time.Now()).next}
	if len(res.ackedIDs) == 0 && len(res.parkedIDs) == 0 && res.transient > 0 {
		return stepOutcome{next: backOff, wait: r.globalBackoff(), rows: len(c.msgs)}
	}
	if len(res.ackedIDs) > 0 || len(res.parkedIDs) > 0 {
		// Only progress ends a run of global failures: an empty claim between two failed
		// retries (every failing chain still waiting) must not reset the backoff.
		r.idleFails = 0
	}
	if kind == claimRetry || !c.exhausted() {
		out.next = claimAgain
	}
	return out
}

// serverChanged reports whether claim c ran on another server than the claims before it, and
// records c's server as the relay's. The claim cursor and the pending delete are facts about
// one server: the cursor's reference snapshot holds that server's transaction ids, and every
// row at or below its position was handled there. A standby promoted after a failover (or a
// server that recovered from a crash) may lack the last commits the relay saw: its id sequence
// and its transaction id counter are then behind, and rows written on it after the switch get
// ids at or below the cursor and transaction ids the old snapshot counts as finished, so a
// relay that kept its cursor would skip them for as long as it runs (its leases survive an
// outage shorter than the lease fence; TestRelayFollowsAFailoverToAStandbyThatLagged).
// Detected by the server's start time (every failover or restart changes it) and, for a
// crash recovery without a restart of the postmaster, by a snapshot whose xmax went
// backwards. The caller restarts the cursor, as for shards it acquires.
func (r *Relay) serverChanged(c *claimed) (bool, string) {
	prev := r.server
	if !c.server.IsZero() {
		r.server = c.server
	}
	switch {
	case !prev.IsZero() && !c.server.IsZero() && !c.server.Equal(prev):
		return true, fmt.Sprintf("server started at %s, the last claim's at %s", c.server.Format(time.RFC3339Nano), prev.Format(time.RFC3339Nano))
	case c.kind == claimNext && r.cur.ref != "" && c.snap != "":
		old, ok1 := snapshotXmax(r.cur.ref)
		now, ok2 := snapshotXmax(c.snap)
		if ok1 && ok2 && now < old {
			return true, fmt.Sprintf("transaction ids went backwards: next id %d, the last claim saw %d", now, old)
		}
	}
	return false, ""
}

// advance moves the cursor after a batch (see cursor) and settles retried chains.
func (r *Relay) advance(c *claimed, res *result, blocked blockedSet, now time.Time) {
	// Acknowledged rows count as deleted: their delete is pending (undeleted moves the cursor
	// back if it fails).
	deleted := make(map[int64]bool, len(res.ackedIDs)+len(res.parkedIDs))
	for _, id := range res.ackedIDs {
		deleted[id] = true
	}
	for _, id := range res.parkedIDs {
		deleted[id] = true
	}
	switch c.kind {
	case claimNext:
		if c.low < r.cur.pos {
			// Rows committed late below the cursor may belong to blocked chains.
			r.blocked.lowerFloors(c.low + 1)
		}
		pos := c.low
		if n := len(c.msgs); n > 0 {
			pos = max(pos, c.msgs[n-1].ID)
		}
		if c.exhausted() && c.seq != nil {
			// Every visible row above the cursor was seen: ids handed out but not yet visible
			// are late commits for the next claim.
			pos = max(pos, *c.seq)
		}
		r.cur.pos, r.cur.ref = pos, c.snap
	case claimRetry:
		r.blocked.retried(blocked, c.msgs, func(m *Message) bool { return deleted[m.ID] }, c.exhausted(), now)
	}
	// A row neither acknowledged nor held by a blocked chain (the batch was abandoned, the
	// block list is full) must be claimed again: move the cursor back before it. (A failed
	// delete of acknowledged rows does the same later, in undeleted.)
	for _, m := range c.msgs {
		if !deleted[m.ID] && !r.blocked.has(m.blockKey) && m.ID-1 < r.cur.pos {
			r.cur.pos = m.ID - 1
			break // msgs are in id order: the first one is the lowest
		}
	}
}

func (r *Relay) globalBackoff() time.Duration {
	r.idleFails++
	return backoffDelay(r.cfg.RetryBackoff, r.cfg.MaxRetryBackoff, r.idleFails, rand.Float64())
}

// finish records the batch's outcome: acknowledged rows queued for deletion (pendingDelete),
// undeliverable failures counted and parked at the limit. It uses its own context: recording
// failures is worth finishing even when shutdown or a lost lease cancelled the batch.
func (r *Relay) finish(ctx context.Context, snap snapshot, msgs []*Message, res *result) {
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.StatementTimeout)
	defer cancel()
	now := time.Now()
	if len(res.ackedMsgs) > 0 {
		r.pending.server = r.server // the rows were claimed there (step checked serverChanged)
	}
	for _, m := range res.ackedMsgs {
		r.pending.ids = append(r.pending.ids, m.ID)
		r.pending.chains = append(r.pending.chains, m.blockKey)
		r.blocked.ok(m)
	}
	if len(res.culprits) > 0 {
		r.recordFailures(fctx, snap, res, now)
	}
	for _, m := range res.transientMsgs {
		r.blocked.fail(m, 0, now)
	}
	for _, h := range res.held {
		r.blocked.holdUntil(h.msg, h.until)
	}
	// Whatever happened to each row, the floor of a tracked chain must not pass a row of it
	// that is still pending: its later rows would be retried, and delivered, before it.
	if len(r.blocked.entries) > 0 {
		acked := make(map[int64]bool, len(res.ackedIDs))
		for _, id := range res.ackedIDs {
			acked[id] = true
		}
		for _, m := range msgs {
			if !acked[m.ID] {
				r.blocked.lowerFloor(m.blockKey, m.ID)
			}
		}
	}
}

// pendingDelete is the acknowledged rows of the last batch, waiting for their DELETE. It is sent
// in the next claim's round trip, before the claim and in its transaction (runClaim), which
// saves each batch a round trip to PostgreSQL: under load the relay's steps are mostly waits
// for its answers. The order stays what the claims need: the claim's snapshot is taken after
// the delete and sees it, never a delete still in progress (a claim that skipped rows still
// being deleted by an id range would also skip a row of the same key committed late inside
// that range while taking the key's later rows, and reorder the key). If the claim fails,
// the delete is rolled back with it and sent again. When no claim comes soon (the loop
// waits longer than BusyPollInterval, backs off, gives shards back or stops), flushPending
// deletes them on their own. Until then they are acknowledged rows still in the outbox, which
// a crash publishes again with the same event ids, as it would between ack and delete.
//
// A prefetched claim (prefetch.go) takes the pending delete along in the same way; if that
// delete fails, its rows are pending again and go with the next claim.
//
// Only ids and chains are kept, not the messages: their payloads (up to MaxBatchBytes) must
// not stay alive while the next batch is read.
type pendingDelete struct {
	ids    []int64
	chains []string  // blockKey of each row, in the order of ids
	server time.Time // start time of the server the rows were claimed from (deleteAcked)
}

// flushPending deletes the pending acknowledged rows now. If that fails, the rows are treated
// as not delivered: the cursor (or their blocked chain's floor) moves back so they are claimed
// and published again (same event ids) before any later row of their key.
func (r *Relay) flushPending(ctx context.Context) {
	r.takePrefetch() // the loop waits: its claim would be stale, its delete is settled here
	if len(r.pending.ids) == 0 {
		return
	}
	p := r.pending
	r.pending = pendingDelete{}
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.StatementTimeout)
	defer cancel()
	if err := r.deleteAcked(fctx, p); err != nil {
		r.m.Failed(FailureDatabase, 1)
		r.log.Warn("relay could not delete acknowledged rows; they will be published again (same event ids)", "rows", len(p.ids), "err", err)
		r.undeleted(p)
	}
}

// undeleted puts rows whose delete failed back in the way of the claims: the floor of their
// blocked chain, else the cursor, moves back before them.
func (r *Relay) undeleted(p pendingDelete) {
	for i, id := range p.ids {
		switch {
		case r.blocked.has(p.chains[i]):
			r.blocked.lowerFloor(p.chains[i], id)
		case id-1 < r.cur.pos:
			r.cur.pos = id - 1
		}
	}
}

// deleteAcked deletes acknowledged rows in one round trip. The commit does not wait for the
// WAL flush (synchronous_commit off for this transaction only): if the server crashes before
// the flush, the rows come back and are published again with the same event ids, which the
// contract allows, and every batch saves a disk flush. The two statements run as one implicit
// transaction (a pgx batch ends with a single Sync), so the setting ends with it.
func (r *Relay) deleteAcked(ctx context.Context, p pendingDelete) error {
	b := &pgx.Batch{}
	b.Queue(`SELECT ` + asyncCommit)
	b.Queue(r.q.deleteAcked, p.ids, p.server)
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
			r.topics.forget(c.msg.Topic, c.msg.ID)
			r.log.Error("relay parked a row the broker keeps refusing; later rows of its key now flow (its order is broken by design); inspect with `onceflow outbox parked`, replay with `onceflow outbox replay`",
				"id", c.msg.ID, "event_id", c.msg.EventID, "topic", c.msg.Topic, "key", c.msg.Key, "attempts", c.msg.Attempts+1, "err", c.err)
			continue
		}
		d := r.blocked.fail(c.msg, c.msg.Attempts+1, now)
		if !c.until.IsZero() {
			// Refused with its whole topic: retried when the topic reopens, with its other rows.
			r.blocked.retryAt(c.msg, c.until)
			d = c.until.Sub(now)
		}
		r.log.Debug("relay: broker refused a row; its key waits and retries",
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
