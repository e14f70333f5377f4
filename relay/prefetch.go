package relay

import (
	"context"
	"slices"
)

// A prefetch is the next cursor claim, sent while the batch before it is being published, so
// that during a drain a batch's claim and the previous batch's produce overlap instead of
// adding up (each was 2–5 ms of a step; the relay's own batch log in docs/PERFORMANCE.md).
//
// It is a guess that the batch in flight ends the usual way: every row acknowledged, so the
// cursor moves to its last row and no chain gets blocked. The loop uses the prefetched rows only
// when that is what happened (usable), and otherwise drops them and claims again: the claim
// itself takes no locks and changes nothing, so a dropped one cost a read (the delete it
// carried is settled either way, see takePrefetch). What can differ, and why
// each one voids the guess:
//   - the cursor: a row was abandoned (lease lost, shutdown) or the block list was full, so
//     the cursor moved back before it; or the shards changed, which resets it;
//   - blocked chains: a row failed, so later rows of its key, which the prefetch may hold, must
//     wait for it (the prefetch is only sent while no chain is blocked, so it excluded none);
//   - late commits: the prefetch found rows committed below the cursor and started below it,
//     where the batch in flight has rows that are not deleted yet: it would publish them twice.
//
// The prefetch also carries the pending delete (pendingDelete) of the batch before the one in
// flight, in its round trip, before its own snapshot, as every claim does.
type prefetch struct {
	done   chan struct{}
	from   cursor // the cursor the claim started from: what advance sets if the batch goes well
	shards []int  // the lease snapshot's shards it read
	del    pendingDelete

	// Set by the goroutine before done is closed.
	c       *claimed
	deleted bool // del committed
	err     error
}

// startPrefetch sends the claim that follows the batch c (a full cursor claim being published,
// of at most half the byte budget) on a goroutine of its own, with the pending delete.
func (r *Relay) startPrefetch(ctx context.Context, snap snapshot, c *claimed) {
	from := cursor{pos: max(c.low, c.msgs[len(c.msgs)-1].ID), ref: c.snap, gen: snap.gen}
	p := &prefetch{done: make(chan struct{}), from: from, shards: snap.shards, del: r.pending}
	r.pending = pendingDelete{}
	// The two batches together stay within one byte budget: the relay's memory bound does not
	// change (step prefetches only after a batch of at most half the budget).
	sql, args := r.q.nextSQL(snap, r.cfg.Shards, from, blockedSet{}, r.cfg.BatchSize, r.cfg.MaxBatchBytes-c.bytes)
	// Its own context: the batch's (cancelled when the step ends) would cancel it mid-flight.
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.StatementTimeout)
	go func() {
		defer close(p.done)
		defer cancel()
		p.c, p.deleted, p.err = r.runClaim(pctx, claimNext, sql, args, r.cfg.BatchSize, p.del)
	}()
	r.prefetched = p
}

// takePrefetch waits for the prefetch in flight, if any, and settles its delete: rows it did
// not delete are pending again, before those acknowledged since. It returns the prefetch (nil
// when none was sent).
func (r *Relay) takePrefetch() *prefetch {
	p := r.prefetched
	if p == nil {
		return nil
	}
	r.prefetched = nil
	<-p.done
	if !p.deleted && len(p.del.ids) > 0 {
		r.pending = pendingDelete{
			ids:    append(p.del.ids, r.pending.ids...),
			chains: append(p.del.chains, r.pending.chains...),
			server: p.del.server,
		}
	}
	return p
}

// usable reports whether the prefetched rows are the claim the loop would send now (see
// prefetch): same cursor, same shards, no blocked chain, no late commit below the cursor.
func (p *prefetch) usable(cur cursor, snap snapshot, blocked *blockList) bool {
	return p.err == nil && p.from == cur && slices.Equal(p.shards, snap.shards) &&
		len(blocked.entries) == 0 && p.c.low == p.from.pos
}
