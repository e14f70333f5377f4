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
	// held are rows not sent because their topic is closed (topicGate), the first of each
	// chain, with until when the topic stays closed.
	held []heldMsg
}

type culprit struct {
	msg *Message
	err error
	// until, when set, is when the row's chain is tried again: the reopening of its topic,
	// refused as a whole (topicGate), instead of a backoff of the row's own.
	until time.Time
}

type heldMsg struct {
	msg   *Message
	until time.Time
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
	res := &result{ackedIDs: make([]int64, 0, len(msgs)), ackedMsgs: make([]*Message, 0, len(msgs))}
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
				res.culprits = append(res.culprits, culprit{msg: m, err: Undeliverable(m.badMetadata)})
			}
		case m.Attempts > 0 && !r.topics.known(m.Topic):
			// (A row of a topic refused as a whole goes with the others: they all fail or
			// succeed together, and one at a time a probe would charge a single row.)
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
	if ctx.Err() != nil {
		return // abandoned: nothing of it is sent, held or charged
	}
	todo := make([]*Message, 0, len(msgs))
	now := time.Now()
	for _, m := range msgs {
		if failed[m.blockKey] {
			continue
		}
		if c := r.topics.closedFor(m.Topic, now); c != nil {
			// The broker refused the topic as a whole moments ago: do not make this batch wait
			// for the same refusal. The chain waits until the topic may be tried again, and the
			// row counts that refusal unless it already did: a row first claimed now, or one
			// that was due when another claim probed the topic, keeps in step with the rows
			// that were sent (see topicGate).
			failed[m.blockKey] = true
			if c.count(m.ID) {
				res.culprits = append(res.culprits, culprit{msg: m, err: c.err, until: c.until})
				r.m.Failed(FailureUndeliverable, 1)
			} else {
				res.held = append(res.held, heldMsg{m, c.until})
			}
			continue
		}
		todo = append(todo, m)
	}
	if len(todo) == 0 {
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
	refusedTopics := map[string]error{}
	topicCulprits := map[string][]int{} // topic → indexes in res.culprits
	for i, m := range todo {
		err := errs[i]
		topic, topicRefused := topicOf(err)
		switch {
		case topicRefused && IsUndeliverable(err):
			// The whole topic is refused: no culprit to search for, every row sent was refused
			// for the same reason. The first row of each chain is charged an attempt.
			refusedTopics[topic] = err
			if !failed[m.blockKey] && !abandoned {
				topicCulprits[topic] = append(topicCulprits[topic], len(res.culprits))
				res.culprits = append(res.culprits, culprit{msg: m, err: err})
				r.m.Failed(FailureUndeliverable, 1)
				r.flog.add(m, err, true, time.Now())
			}
			failed[m.blockKey] = true
		case err == nil:
			if len(r.topics.closed) > 0 {
				r.topics.delivered(m.Topic)
			}
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
	for topic, err := range refusedTopics {
		c := r.topics.refused(topic, err, time.Now())
		for _, i := range topicCulprits[topic] {
			c.count(res.culprits[i].msg.ID)
			res.culprits[i].until = c.until
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
			res.culprits = append(res.culprits, culprit{msg: m, err: undelivErr[i]})
			r.m.Failed(FailureUndeliverable, 1)
			r.flog.add(m, undelivErr[i], true, time.Now())
		}
		return
	}
	// Several messages failed together: find out which one(s) the broker really refuses. A
	// held-back row of the same chain in this call already marked the chain failed; that mark
	// must not keep the chain's head out of the halves (it would never be charged, and a
	// broker that rejects its whole batch every time would never get it parked), so the marks
	// are lifted for the halves and put back after them for every chain with a row this call
	// did not deliver.
	for _, m := range undeliv {
		delete(failed, m.blockKey)
	}
	h := len(undeliv) / 2
	r.send(ctx, undeliv[:h], failed, res)
	r.send(ctx, undeliv[h:], failed, res)
	for i, m := range todo {
		if errs[i] != nil {
			failed[m.blockKey] = true
		}
	}
}
