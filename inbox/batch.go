package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/outbox"
)

// BatchProcessor applies the messages of one partition in batches: what a batched consumer
// (inbox/inboxkafka.BatchConsumer) drives. An Inbox makes one from a Watermill handler
// (Inbox.Batch, Inbox.BatchNoPublish) or a set-based handler (Inbox.BatchFunc); the saga
// orchestrator and participants are BatchProcessors too.
//
// The consumer keeps the order of a partition: it hands ProcessBatch consecutive messages and
// moves on only when every one of them is settled — processed, skipped as a duplicate, or
// given up with SettlePoison.
type BatchProcessor interface {
	// ProcessBatch applies msgs in order. On success every message's effect and dedup row
	// have committed. On error nothing of the failed transaction is kept, and the error says
	// who failed: a *MessageError for one message's handler (or, with Index −1, a set-based
	// handler that did not say which), any other error for the batch as a whole (the
	// database could not be reached): the consumer then retries the same messages.
	//
	// It may commit in several transactions (a participant commits the messages before a
	// failed step separately): a message's effect always commits with its dedup row, so the
	// retry skips what already committed.
	ProcessBatch(ctx context.Context, msgs []*message.Message) error
	// SettlePoison records that msg is given up after p.Attempts failed attempts (p.Err is
	// the last error), in one transaction with its dedup row, so the consumer moves past it
	// exactly once and a redelivery is skipped. An error means nothing was recorded; the
	// consumer retries.
	SettlePoison(ctx context.Context, msg *message.Message, p Poison) error
}

// MessageError is the error of a BatchProcessor whose handler failed on one message.
type MessageError struct {
	// Index is the failed message's position in the batch, or −1 when a set-based handler
	// failed without saying which message caused it (the consumer then splits the batch in
	// halves to find it).
	Index int
	Err   error
}

func (e *MessageError) Error() string {
	if e.Index < 0 {
		return "batch handler: " + e.Err.Error()
	}
	return fmt.Sprintf("message %d of the batch: %v", e.Index, e.Err)
}

func (e *MessageError) Unwrap() error { return e.Err }

// Poison says why a message is given up.
type Poison struct {
	// Source is where the message came from, e.g. "orders.placed/3@1234" (topic, partition,
	// offset), as shown by `onceflow inbox poison`.
	Source string
	// Attempts is how many times the message failed; Err is its last error.
	Attempts int
	Err      error
	// Handler and PublishTopic are, for a router consumer (the Poison middleware), the
	// Watermill handler the message failed in and its publish topic: a replay runs that
	// handler again (Inbox.RouterPlugin). Empty for batched consumers.
	Handler, PublishTopic string
	// NoReplay, when set, says why `onceflow inbox poison replay` must refuse this message
	// and what to do instead: the saga engine sets it for a reply whose saga it set stuck
	// (`onceflow saga retry` resumes the saga) and for an invalid command.
	NoReplay string
}

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
	return p.ib.processBatch(ctx, msgs, p.topic, p.perMessage, p.set, nil)
}

// CheckSchema is the Inbox's: the batched consumer calls it before it starts.
func (p *batchProcessor) CheckSchema(ctx context.Context) error { return p.ib.CheckSchema(ctx) }

// SettlePoison implements BatchProcessor.
func (p *batchProcessor) SettlePoison(ctx context.Context, msg *message.Message, ps Poison) error {
	return p.ib.SettlePoison(ctx, msg, ps)
}

// processBatch is the inbox's one unit of work: ProcessBatch for either kind of handler, and
// the middleware's transaction (a batch of one). Every dedup key is claimed in one statement
// (one key: the plain INSERT), the handler runs for each new message in order, every message
// the handlers return is written in one outbox statement, and everything commits at once.
//
// rp, when not nil, makes it the replay of a poison row (msgs is its one message): in the same
// transaction, before the claim, the row is marked replayed and the message's dedup row is
// removed, so the claim finds the key new again and the handler runs once more — all of it
// commits together or not at all (replay.go). The recorded dedup key is the message's key.
func (ib *Inbox) processBatch(ctx context.Context, msgs []*message.Message, topic string, h message.HandlerFunc, set BatchHandlerFunc, rp *replayRow) (err error) {
	consumer := ib.cfg.Consumer
	keys := make([]string, 0, len(msgs))
	keyed := make([]int, 0, len(msgs)) // index in msgs of each key
	for i, msg := range msgs {
		key, err := ib.key(msg)
		if rp != nil {
			// The key it was given up under: the replay removes exactly that dedup row, even
			// if KeyFunc changed since.
			key, err = rp.key, nil
		}
		if err != nil {
			ib.cfg.Metrics.NoKey(consumer)
			ib.endEarly(msg, outcomeNoKey, nil)
			if ib.cfg.NoKeyPolicy == DropNoKey {
				ib.cfg.Logger.Warn("inbox: message without a dedup key dropped (acknowledged, handler not run)",
					"message_uuid", msg.UUID, "err", err, "metadata", map[string]string(msg.Metadata))
				continue
			}
			// Poison (IsPoison): the consumer settles it at once instead of retrying.
			return &MessageError{Index: i, Err: fmt.Errorf("inbox: consumer %q, message %q: %w", consumer, msg.UUID, err)}
		}
		keys = append(keys, key)
		keyed = append(keyed, i)
	}
	if len(keys) == 0 {
		return nil
	}
	start := time.Now()
	// A connection slot first (see Config.Pool), given back after the transaction ended: the
	// deferred release below runs after the deferred rollback.
	if err := ib.slots.acquire(ctx); err != nil {
		for range keys {
			ib.cfg.Metrics.Failed(consumer)
		}
		return fmt.Errorf("inbox: consumer %q: wait for a connection of the pool: %w", consumer, err)
	}
	defer ib.slots.release()
	tx, err := ib.cfg.Pool.Begin(ctx)
	if err != nil {
		for range keys {
			ib.cfg.Metrics.Failed(consumer)
		}
		return fmt.Errorf("inbox: consumer %q: begin transaction: %w", consumer, err)
	}
	committed := false
	defer func() {
		if !committed {
			// Reached on every path that did not commit: nothing of the attempt survives.
			for range keys {
				ib.cfg.Metrics.Failed(consumer)
			}
			ib.rollback(ctx, tx, nil)
		}
	}()
	if err := TakeTurnTx(ctx, tx, consumer); err != nil {
		return err
	}
	if rp != nil {
		started, err := ib.startReplayTx(ctx, tx, rp)
		if err != nil {
			return err
		}
		if !started {
			// Applied by another process of the consumer meanwhile, or deleted: nothing to do.
			committed = true
			ib.rollback(ctx, tx, nil)
			return nil
		}
	}
	claimed, err := ib.ClaimTx(ctx, tx, keys...)
	if err != nil {
		return err
	}
	fresh := make([]*message.Message, 0, len(keys))
	freshIdx := make([]int, 0, len(keys))
	for j, ok := range claimed {
		if ok {
			fresh = append(fresh, msgs[keyed[j]])
			freshIdx = append(freshIdx, keyed[j])
		} else {
			ib.cfg.Metrics.Duplicate(consumer)
			ib.endEarly(msgs[keyed[j]], outcomeDuplicate, nil)
			ib.cfg.Logger.Debug("inbox: duplicate skipped", "message_uuid", msgs[keyed[j]].UUID, "dedup_key", keys[j])
		}
	}
	if len(fresh) == 0 {
		committed = true // nothing to undo: every key was recorded already
		ib.rollback(ctx, tx, nil)
		return nil
	}
	var produced []*message.Message
	var origin []int // index in msgs of the message whose handler returned produced[i]; nil for a set handler
	if set != nil {
		produced, err = ib.runSet(ctx, tx, fresh, set)
		if me := (*MessageError)(nil); errors.As(err, &me) && me.Index >= 0 && me.Index < len(freshIdx) {
			me.Index = freshIdx[me.Index]
		}
	} else {
		produced, origin, err = ib.runEach(ctx, tx, fresh, freshIdx, h)
	}
	if err != nil {
		return err
	}
	// The handlers succeeded: cancellation (a revoked partition, a closing consumer) no longer
	// applies, see Config.CommitTimeout.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ib.cfg.CommitTimeout)
	defer cancel()
	if len(produced) > 0 {
		if err := ib.writeProduced(cctx, tx, topic, produced); err != nil {
			// A message the outbox refuses (no topic, too large, no valid UUID) is its
			// handler's: retrying the batch cannot fix it, so say whose it is (poison:
			// settled at once), or let the consumer halve a set handler's batch.
			var ve *outbox.ValidationError
			switch {
			case errors.As(err, &ve) && origin != nil && ve.Index >= 0 && ve.Index < len(origin):
				return &MessageError{Index: origin[ve.Index], Err: err}
			case IsPoison(err):
				return &MessageError{Index: -1, Err: err}
			}
			return err
		}
	}
	if err := tx.Commit(cctx); err != nil {
		return BlameCommit(fmt.Errorf("inbox: consumer %q: commit a batch of %d: %w", consumer, len(fresh), err), tx.Conn(),
			len(freshIdx), func(i int) int { return freshIdx[i] })
	}
	committed = true
	took := time.Since(start)
	for range fresh {
		ib.cfg.Metrics.Processed(consumer, took)
	}
	return nil
}

// endEarly records the `process` span of a message that ends before its handler would run.
func (ib *Inbox) endEarly(msg *message.Message, outcome string, err error) {
	_, span := ib.startProcess(msg.Context(), msg)
	endProcess(span, outcome, err)
}

// runEach runs h for each message on a view of tx, in order, and collects what they return.
func (ib *Inbox) runEach(ctx context.Context, tx pgx.Tx, fresh []*message.Message, idx []int, h message.HandlerFunc) (produced []*message.Message, origin []int, err error) {
	for j, msg := range fresh {
		out, err := ib.runOne(tx, msg, h)
		if err != nil && ctx.Err() != nil {
			return nil, nil, err // the consumer is stopping: nobody's attempt
		}
		// A deadlock, a serialization failure, a lost connection: the batch's failure, not
		// the message's. The consumer runs the batch again without counting an attempt
		// against the message. Anything else is the message's.
		if err := Blame(err, tx.Conn(), idx[j]); err != nil {
			return nil, nil, err
		}
		produced = append(produced, out...)
		for range out {
			origin = append(origin, idx[j])
		}
	}
	return produced, origin, nil
}

// runOne runs h for one message of a batch, with the transaction (a view it cannot end) and
// the message's `process` span in its context. A panic is returned as the message's error.
func (ib *Inbox) runOne(tx pgx.Tx, msg *message.Message, h message.HandlerFunc) (out []*message.Message, err error) {
	orig := msg.Context()
	defer msg.SetContext(orig)
	pctx, span := ib.startProcess(orig, msg)
	outcome := outcomeFailed
	defer func() { endProcess(span, outcome, err) }()
	view, viewDone := pgsql.ManagedTx(tx, ib.errManaged)
	msg.SetContext(outbox.ContextWithTx(pctx, view))
	out, err = callHandler(msg, h)
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

// callHandler runs h, turning a panic into an error: in a batch, one message's panic must fail
// that message (and be isolated), not the consumer.
func callHandler(msg *message.Message, h message.HandlerFunc) (out []*message.Message, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = &panicError{v: r}
		}
	}()
	return h(msg)
}

// panicError is a handler's panic as the message's error; the middleware panics again with v
// once the transaction is rolled back, so Recoverer (or the router) sees the original panic.
type panicError struct{ v any }

func (e *panicError) Error() string { return fmt.Sprintf("%v: handler panicked: %v", ErrPanicked, e.v) }
func (e *panicError) Unwrap() error { return ErrPanicked }

// ErrPanicked is wrapped by the error of a message whose handler panicked in a batch.
var ErrPanicked = errors.New("inbox: panic")

// runSet runs a set-based handler on a view of tx.
func (ib *Inbox) runSet(ctx context.Context, tx pgx.Tx, fresh []*message.Message, set BatchHandlerFunc) (out []*message.Message, err error) {
	view, viewDone := pgsql.ManagedTx(tx, ib.errManaged)
	func() {
		defer func() {
			if r := recover(); r != nil {
				err = &MessageError{Index: -1, Err: fmt.Errorf("%w: batch handler panicked: %v", ErrPanicked, r)}
			}
		}()
		out, err = set(ctx, view, fresh)
	}()
	if viewErr := viewDone(); err == nil && viewErr != nil {
		err = fmt.Errorf("inbox: consumer %q: %w", ib.cfg.Consumer, viewErr)
	}
	if err != nil {
		if me := (*MessageError)(nil); !errors.As(err, &me) && ctx.Err() == nil {
			err = Blame(err, tx.Conn(), -1)
		}
		return nil, err
	}
	return out, nil
}

// SettlePoison records msg as given up in processed_event and inbox_poison, in one
// transaction: the consumer then moves past it, a redelivery is skipped, and `onceflow inbox
// poison` shows it with its error. A message without a usable key gets the poison row only.
// It is the BatchProcessor's SettlePoison of Batch, BatchNoPublish and BatchFunc; other
// processors (the saga's) call it to record their own poison.
func (ib *Inbox) SettlePoison(ctx context.Context, msg *message.Message, p Poison) error {
	var settled bool
	err := pgx.BeginFunc(ctx, ib.cfg.Pool, func(tx pgx.Tx) error {
		var err error
		settled, err = ib.SettlePoisonTx(ctx, tx, msg, p)
		return err
	})
	if err == nil && settled {
		ib.LogPoison(msg, p)
	}
	return err
}

// LogPoison logs and counts a message recorded as poison, once its transaction committed.
func (ib *Inbox) LogPoison(msg *message.Message, p Poison) {
	ib.cfg.Metrics.Poisoned(ib.cfg.Consumer)
	ib.cfg.Logger.Error("inbox: message given up; recorded as poison and skipped (`onceflow inbox poison` lists it; once the cause is fixed, `onceflow inbox poison replay` re-drives it through this consumer)",
		"message_uuid", msg.UUID, "source", p.Source, "attempts", p.Attempts, "err", p.Err)
}

// SettlePoisonTx is SettlePoison in the caller's transaction; settled reports whether msg was
// given up now. A message whose dedup key is already recorded (another delivery of it
// committed meanwhile, or the last attempt's commit went through as its connection dropped)
// is not: it gets no poison row, and settled is false.
func (ib *Inbox) SettlePoisonTx(ctx context.Context, tx pgx.Tx, msg *message.Message, p Poison) (settled bool, err error) {
	var key *string
	if k, err := ib.key(msg); err == nil {
		key = &k
		claimed, err := ib.ClaimTx(ctx, tx, k)
		if err != nil {
			return false, err
		}
		if !claimed[0] {
			return false, nil // another delivery of it committed meanwhile: nothing to give up
		}
	}
	md, err := json.Marshal(msg.Metadata)
	if err != nil {
		return false, fmt.Errorf("inbox: consumer %q: encode the metadata of poison message %q: %w", ib.cfg.Consumer, msg.UUID, err)
	}
	reason := "unknown error"
	if p.Err != nil {
		reason = p.Err.Error()
	}
	payload := msg.Payload
	if payload == nil {
		payload = []byte{}
	}
	var noReplay *string
	if p.NoReplay != "" {
		noReplay = &p.NoReplay
	}
	if _, err := tx.Exec(ctx, ib.poisonSQL, ib.cfg.Consumer, key, msg.UUID, p.Source, md, payload, p.Attempts, reason,
		p.Handler, p.PublishTopic, noReplay); err != nil {
		return false, ib.dbError(fmt.Sprintf("record poison message %q", msg.UUID), err)
	}
	return true, nil
}
