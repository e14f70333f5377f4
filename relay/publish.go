package relay

import (
	"context"
	"errors"
	"time"
)

// result is the outcome of publishing one claimed batch.
type result struct {
	ackedIDs  []int64
	ackedMsgs []*Message
	// culprits failed as undeliverable on their own (not as collateral of another message).
	culprits []culprit
	// transientMsgs are the first failed message of each chain that failed transiently.
	transientMsgs []*Message
	transient     int
	parkedIDs     []int64
	// deleted is false when deleting the acknowledged rows failed (they stay in the outbox).
	deleted bool
}

type culprit struct {
	msg *Message
	err error
}

// publish sends a claimed batch through the sink and classifies every row.
//
// Order: rows go in id order; once a row of a chain (a key, or a single keyless row) fails,
// later rows of that chain in this batch are held back and wait for a later batch. Rows that
// already failed as undeliverable before (attempts > 0) are sent alone, at their place in the
// order, so a poison row does not drag its neighbours into failing again.
//
// Attribution: a sink may fail several messages with the same undeliverable error when the
// broker rejects a whole request (a Kafka record batch). Only a message that fails alone is
// charged an attempt; when several fail together, they are split in halves and sent again,
// earlier half first, until every failure is pinned on one message. Collateral messages are
// then simply delivered.
func (r *Relay) publish(ctx context.Context, msgs []*Message) *result {
	res := &result{ackedIDs: make([]int64, 0, len(msgs)), ackedMsgs: make([]*Message, 0, len(msgs)), deleted: true}
	failed := map[string]bool{}
	var seg []*Message
	flush := func() {
		if len(seg) > 0 {
			r.send(ctx, seg, failed, res)
			seg = nil
		}
	}
	for _, m := range msgs {
		switch {
		case m.badMetadata != nil:
			flush()
			if !failed[m.blockKey] {
				failed[m.blockKey] = true
				res.culprits = append(res.culprits, culprit{m, Undeliverable(m.badMetadata)})
			}
		case m.Attempts > 0:
			flush()
			r.send(ctx, []*Message{m}, failed, res)
		default:
			seg = append(seg, m)
		}
	}
	flush()
	return res
}

// send publishes msgs minus the chains that already failed in this batch, and bisects
// ambiguous undeliverable failures.
func (r *Relay) send(ctx context.Context, msgs []*Message, failed map[string]bool, res *result) {
	todo := make([]*Message, 0, len(msgs))
	for _, m := range msgs {
		if !failed[m.blockKey] {
			todo = append(todo, m)
		}
	}
	if len(todo) == 0 || ctx.Err() != nil {
		return
	}
	errs := make([]error, len(todo))
	start := time.Now()
	sctx, span := r.startSend(ctx, todo)
	r.sink.Publish(sctx, todo, errs)
	took := time.Since(start)
	r.endSend(span, errs)
	abandoned := ctx.Err() != nil

	var undeliv []*Message
	var undelivErr []error
	acked, transient := 0, 0
	for i, m := range todo {
		err := errs[i]
		switch {
		case err == nil:
			if failed[m.blockKey] {
				// A sink broke its contract: this key may now be out of order in the broker.
				r.log.Error("relay: sink acknowledged a message after an earlier message of the same key failed in the same call; per-key order may be broken",
					"id", m.ID, "event_id", m.EventID, "key", m.Key)
			}
			res.ackedIDs = append(res.ackedIDs, m.ID)
			res.ackedMsgs = append(res.ackedMsgs, m)
			acked++
		case errors.Is(err, ErrHeldBack):
			failed[m.blockKey] = true
		case IsUndeliverable(err):
			undeliv = append(undeliv, m)
			undelivErr = append(undelivErr, err)
		default:
			if !failed[m.blockKey] && !abandoned {
				res.transientMsgs = append(res.transientMsgs, m)
			}
			if !abandoned {
				r.flog.add(m, err, false, time.Now())
			}
			failed[m.blockKey] = true
			transient++
		}
	}
	if acked > 0 {
		r.m.Published(acked, took)
	}
	if transient > 0 && !abandoned {
		res.transient += transient
		r.m.Failed(FailureTransient, transient)
	}
	if len(undeliv) == 0 {
		return
	}
	if len(undeliv) == 1 || len(todo) == 1 {
		for i, m := range undeliv {
			failed[m.blockKey] = true
			res.culprits = append(res.culprits, culprit{m, undelivErr[i]})
			r.m.Failed(FailureUndeliverable, 1)
			r.flog.add(m, undelivErr[i], true, time.Now())
		}
		return
	}
	// Several messages failed together: find out which one(s) the broker really refuses.
	h := len(undeliv) / 2
	r.send(ctx, undeliv[:h], failed, res)
	r.send(ctx, undeliv[h:], failed, res)
}
