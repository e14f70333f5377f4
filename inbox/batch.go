package inbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/internal/engine"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/outbox"
)

// BatchProcessor applies the messages of one partition in batches: what a batched consumer
// (inbox/inboxkafka.BatchConsumer) drives. An Inbox makes one from a Watermill handler
// (Inbox.Batch, Inbox.BatchNoPublish) or a set-based handler (Inbox.BatchFunc); the saga
// orchestrator and participants are BatchProcessors too. See its methods for the protocol.
type BatchProcessor = engine.BatchProcessor

// MessageError is the error of a BatchProcessor whose handler failed on one message: it counts
// an attempt against that message. Index is the message's position in the batch, or −1 when a
// set-based handler failed without saying which (the consumer then splits the batch).
type MessageError = engine.MessageError

// GiveUp says why a message is given up (BatchProcessor.SettlePoison): where it came from
// (Source), its attempts and last error, for a router consumer the handler and publish topic a
// replay runs again, and, when set, why a replay must be refused (NoReplay).
type GiveUp = engine.GiveUp

// ErrPanicked is wrapped by the error of a message whose handler panicked: in a batch the
// panic fails that message (it counts an attempt like any other error); the router's
// Middleware panics again after its rollback, so Watermill's Recoverer sees the original panic.
var ErrPanicked = engine.ErrPanicked

// BatchHandlerFunc is a set-based handler: it applies msgs (the new ones of a batch, in order,
// duplicates already removed) in tx, which it must not end, and returns the messages to write
// to the outbox in the same transaction. Return a *MessageError to say which message failed.
type BatchHandlerFunc func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) ([]*message.Message, error)

// Batch returns a BatchProcessor that runs h — the handler you would give the router, with
// outbox.MustTx(msg.Context()) inside — for each new message of a batch, all in one
// transaction: every dedup key claimed in one statement, the handler run per new message in
// order, every message the handlers return written in one outbox statement, one commit.
// Messages the handlers return go to their outbox.ToTopic topic, or else to publishTopic
// ("" when every handler addresses its messages).
func (ib *Inbox) Batch(publishTopic string, h message.HandlerFunc) BatchProcessor {
	return &batchProcessor{ib: ib, topic: publishTopic, perMessage: h}
}

// BatchNoPublish is Batch for a handler that returns no messages (router.AddConsumerHandler's
// kind); it may still write to the outbox itself with outbox.WriteTx on its transaction.
func (ib *Inbox) BatchNoPublish(h message.NoPublishHandlerFunc) BatchProcessor {
	return ib.Batch("", func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
}

// BatchFunc returns a BatchProcessor over a set-based handler, for set-based SQL (one INSERT
// … SELECT FROM unnest for the whole batch). Returned messages without outbox.ToTopic go to
// publishTopic.
func (ib *Inbox) BatchFunc(publishTopic string, h BatchHandlerFunc) BatchProcessor {
	return &batchProcessor{ib: ib, topic: publishTopic, set: h}
}

type batchProcessor struct {
	ib         *Inbox
	topic      string
	perMessage message.HandlerFunc
	set        BatchHandlerFunc
}

// ProcessBatch implements BatchProcessor.
func (p *batchProcessor) ProcessBatch(ctx context.Context, msgs []*message.Message) error {
	return p.ib.processBatch(ctx, msgs, p.topic, p.perMessage, p.set)
}

// CheckSchema is the Inbox's: the batched consumer calls it before it starts.
func (p *batchProcessor) CheckSchema(ctx context.Context) error { return p.ib.CheckSchema(ctx) }

// SettlePoison implements BatchProcessor.
func (p *batchProcessor) SettlePoison(ctx context.Context, msg *message.Message, g GiveUp) error {
	return p.ib.SettlePoison(ctx, msg, g)
}

// processBatch is the inbox's unit of work on the engine (internal/engine): ProcessBatch for
// either kind of handler, and the middleware's transaction (a batch of one). Every dedup key
// is claimed in one statement (one key: the plain INSERT), the handler runs for each new
// message in order, every message the handlers return is written in one outbox statement, and
// everything commits at once.
func (ib *Inbox) processBatch(ctx context.Context, msgs []*message.Message, topic string, h message.HandlerFunc, set BatchHandlerFunc) error {
	u, err := ib.newUnit(msgs, topic, h, set)
	if err != nil || len(u.keys) == 0 {
		return err
	}
	_, err = ib.runUnit(ctx, u, u)
	return err
}

// runUnit runs eu (u, or a replay around it) on the engine and counts u's messages.
func (ib *Inbox) runUnit(ctx context.Context, u *unit, eu engine.Unit) (engine.Result, error) {
	start := time.Now()
	res, err := ib.run.Run(ctx, len(u.msgs), eu)
	switch {
	case err != nil:
		for range u.keys {
			ib.cfg.Metrics.Failed(ib.cfg.Consumer)
		}
	case res.Outcome == engine.Applied:
		took := time.Since(start)
		for range len(res.Applied) - len(u.behind) {
			ib.cfg.Metrics.Processed(ib.cfg.Consumer, took)
		}
	}
	return res, err
}

// unit is the inbox's part of a transaction (engine.Unit): claim the messages' keys, run the
// handler of each new one, write what they returned.
type unit struct {
	ib    *Inbox
	msgs  []*message.Message
	topic string
	h     message.HandlerFunc
	set   BatchHandlerFunc
	keys  []string
	keyed []int // index in msgs of each key
	// produced are the handlers' messages; origin[i] the index in msgs of the message whose
	// handler returned produced[i] (nil for a set handler).
	produced []*message.Message
	origin   []int
	// claimed: the keys are recorded already (a parked message the lane applies): no claim,
	// no lane check.
	claimed bool
	// behind are the messages parked behind their lane in this transaction (not run).
	behind []int
	// noLane: no lane check (a replay: an operator's decision runs at once, ahead of any
	// message parked in its key's lane).
	noLane bool
}

// newUnit reads the messages' dedup keys. A message without a usable key is dropped
// (DropNoKey) or fails as the message's, which no retry can fix (RejectNoKey).
func (ib *Inbox) newUnit(msgs []*message.Message, topic string, h message.HandlerFunc, set BatchHandlerFunc) (*unit, error) {
	u := &unit{ib: ib, msgs: msgs, topic: topic, h: h, set: set, keys: make([]string, 0, len(msgs)), keyed: make([]int, 0, len(msgs))}
	for i, msg := range msgs {
		key, err := ib.key(msg)
		if err != nil {
			ib.cfg.Metrics.NoKey(ib.cfg.Consumer)
			ib.endEarly(msg, outcomeNoKey, nil)
			if ib.cfg.NoKeyPolicy == DropNoKey {
				ib.cfg.Logger.Warn("inbox: message without a dedup key dropped (acknowledged, handler not run)",
					"message_uuid", msg.UUID, "err", err, "metadata", map[string]string(msg.Metadata))
				continue
			}
			return nil, &MessageError{Index: i, Err: fmt.Errorf("inbox: consumer %q, message %q: %w", ib.cfg.Consumer, msg.UUID, err)}
		}
		u.keys = append(u.keys, key)
		u.keyed = append(u.keyed, i)
	}
	return u, nil
}

// Apply implements engine.Unit.
func (u *unit) Apply(ctx context.Context, tx pgx.Tx) ([]int, error) {
	if u.claimed {
		if err := u.run(ctx, tx, u.keyed); err != nil {
			return nil, err
		}
		return u.keyed, nil
	}
	var claimed []bool
	var parked map[string]bool
	var err error
	if u.noLane {
		claimed, err = u.ib.ClaimTx(ctx, tx, u.keys...)
	} else {
		claimed, parked, err = u.ib.claimAndCheckLanes(ctx, tx, u.msgs, u.keys, u.keyed)
	}
	if err != nil {
		return nil, err
	}
	fresh := make([]int, 0, len(u.keys))
	for j, ok := range claimed {
		if ok {
			fresh = append(fresh, u.keyed[j])
			continue
		}
		msg := u.msgs[u.keyed[j]]
		u.ib.cfg.Metrics.Duplicate(u.ib.cfg.Consumer)
		u.ib.endEarly(msg, outcomeDuplicate, nil)
		u.ib.cfg.Logger.Debug("inbox: duplicate skipped", "message_uuid", msg.UUID, "dedup_key", u.keys[j])
	}
	if len(fresh) == 0 {
		return nil, nil
	}
	run, behind, err := u.parkBehind(ctx, tx, fresh, parked)
	if err != nil {
		return nil, err
	}
	u.behind = behind
	if len(run) > 0 {
		if err := u.run(ctx, tx, run); err != nil {
			return nil, err
		}
	}
	return fresh, nil // the parked ones commit too: their dedup and parked rows
}

// run runs the handler for the messages at idx.
func (u *unit) run(ctx context.Context, tx pgx.Tx, idx []int) error {
	if u.set != nil {
		return u.runSet(ctx, tx, idx)
	}
	return u.runEach(ctx, tx, idx)
}

// Write implements engine.Unit: the handlers' messages, in one outbox statement.
func (u *unit) Write(ctx context.Context, tx pgx.Tx) error {
	if len(u.produced) == 0 {
		return nil
	}
	return engine.Refused(u.ib.writeProduced(ctx, tx, u.topic, u.produced), u.origin)
}

// endEarly records the `process` span of a message that ends before its handler would run.
func (ib *Inbox) endEarly(msg *message.Message, outcome string, err error) {
	_, span := ib.startProcess(msg.Context(), msg)
	endProcess(span, outcome, err)
}

// runEach runs the handler for each new message (fresh: their indexes), in order, and keeps
// what they return. A handler's error is blamed by the engine's rule: a deadlock, a lost
// connection is the transaction's (no attempt counted); anything else the message's.
func (u *unit) runEach(ctx context.Context, tx pgx.Tx, fresh []int) error {
	for _, i := range fresh {
		out, err := u.ib.runOne(tx, u.msgs[i], u.h)
		if err := engine.Blame(ctx, err, tx.Conn(), i); err != nil {
			return err
		}
		u.produced = append(u.produced, out...)
		for range out {
			u.origin = append(u.origin, i)
		}
	}
	return nil
}

// runOne runs h for one message, with the transaction (a view it cannot end) and the
// message's `process` span in its context. A panic is the message's error (engine.Call).
func (ib *Inbox) runOne(tx pgx.Tx, msg *message.Message, h message.HandlerFunc) (out []*message.Message, err error) {
	orig := msg.Context()
	defer msg.SetContext(orig)
	pctx, span := ib.startProcess(orig, msg)
	outcome := outcomeFailed
	defer func() { endProcess(span, outcome, err) }()
	view, viewDone := pgsql.ManagedTx(tx, ib.errManaged)
	msg.SetContext(outbox.ContextWithTx(pctx, view))
	out, err = engine.Call(func() ([]*message.Message, error) { return h(msg) })
	for _, m := range out {
		// Its `create` span is a child of this message's `process` span (outbox.Writer).
		if m != nil && !trace.SpanContextFromContext(m.Context()).IsValid() {
			m.SetContext(pctx)
		}
	}
	if viewErr := viewDone(); err == nil && viewErr != nil {
		if errors.Is(viewErr, outbox.ErrTxManaged) {
			ib.cfg.Logger.Error("inbox: the handler tried to end its transaction; the message fails", "message_uuid", msg.UUID, "err", viewErr)
		}
		err = fmt.Errorf("inbox: consumer %q, message %q: %w", ib.cfg.Consumer, msg.UUID, viewErr)
	}
	if err == nil {
		outcome = outcomeProcessed
	}
	return out, err
}

// runSet runs a set-based handler on a view of tx for the new messages.
func (u *unit) runSet(ctx context.Context, tx pgx.Tx, fresh []int) error {
	msgs := make([]*message.Message, len(fresh))
	for j, i := range fresh {
		msgs[j] = u.msgs[i]
	}
	view, viewDone := pgsql.ManagedTx(tx, u.ib.errManaged)
	out, err := engine.Call(func() ([]*message.Message, error) { return u.set(ctx, view, msgs) })
	if viewErr := viewDone(); err == nil && viewErr != nil {
		err = fmt.Errorf("inbox: consumer %q: %w", u.ib.cfg.Consumer, viewErr)
	}
	var me *MessageError
	switch {
	case errors.As(err, &me) && me.Index >= 0 && me.Index < len(fresh):
		return &MessageError{Index: fresh[me.Index], Err: me.Err}
	case errors.As(err, &me):
		return &MessageError{Index: -1, Err: me.Err}
	case err != nil:
		return engine.Blame(ctx, err, tx.Conn(), -1)
	}
	u.produced = out
	return nil
}

// SettlePoison records msg as given up in processed_event and inbox_poison, in one
// transaction: the consumer then moves past it, a redelivery is skipped, and `onceflow inbox
// poison` shows it with its error. A message without a usable key gets the poison row only,
// and a message whose dedup key another delivery recorded meanwhile is not given up. It is the
// BatchProcessor's SettlePoison of Batch, BatchNoPublish and BatchFunc, and what a processor of
// your own calls to record its poison.
func (ib *Inbox) SettlePoison(ctx context.Context, msg *message.Message, g GiveUp) error {
	key, _ := ib.key(msg) // "" without a usable key
	var settled bool
	err := ib.run.InTx(ctx, func(ctx context.Context, tx pgx.Tx) (err error) {
		settled, err = ib.run.GiveUpTx(ctx, tx, msg, key, g)
		return err
	})
	if err != nil {
		return ib.dbError(fmt.Sprintf("record poison message %q", msg.UUID), err)
	}
	if settled {
		ib.cfg.Metrics.Poisoned(ib.cfg.Consumer)
		ib.run.LogGiveUp(msg, g)
	}
	return nil
}
