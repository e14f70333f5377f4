package saga

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/engine"
	"github.com/onceflow/onceflow/outbox"
)

// Retry defaults for messages whose handling fails with an ordinary error: a participant's
// handler returning neither Fail nor Retry (a database hiccup, a bug, a panic), or a reply
// whose transition cannot be applied. Such a message is tried DefaultMaxAttempts times with
// a backoff starting at DefaultRetryBackoff and doubling, then settled so that its partition
// moves on: a command is answered as a failed attempt carrying the error (the orchestrator's
// Attempts, backoff and compensation then apply), a reply sets its saga stuck with the error.
// Redelivering it forever would block every other saga behind it on its partition.
const (
	DefaultMaxAttempts  = engine.DefaultMaxAttempts
	DefaultRetryBackoff = engine.DefaultBackoff
)

var (
	_ inbox.BatchProcessor = (*Orchestrator)(nil)
	_ inbox.BatchProcessor = (*stepProcessor)(nil)
)

// ProcessBatch applies replies of many sagas in one transaction, for
// inboxkafka.BatchConsumer (the Orchestrator is an inbox.BatchProcessor):
//
//	c, err := inboxkafka.NewBatchConsumer(inboxkafka.BatchConfig{Brokers: brokers,
//		Group: "orchestrator", Topics: orch.ReplyTopics(), Processor: orch})
//
// Every reply's dedup key is claimed in one statement, the sagas are locked in one statement
// in id order (two orchestrators never deadlock), replies of the same saga are applied in
// order on one in-memory row, and the rows, timers and every command they send go to the
// server in one pipelined round trip before the commit. A reply whose transition cannot be
// computed fails the batch as an *inbox.MessageError naming it. A reply of a saga whose
// definition version is not registered here is no failure: it is parked in the batch's
// transaction for an orchestrator that has the version (RedriveParked), and the batch goes on.
//
// When a registered definition has local steps, each of which runs in a savepoint, the batch
// is applied in several transactions of at most 60 ÷ (local steps per transition) replies,
// so that no transaction takes more than 60 savepoints.
func (o *Orchestrator) ProcessBatch(ctx context.Context, msgs []*message.Message) error {
	n := o.perTransaction()
	if n == 0 || len(msgs) <= n {
		return o.processBatch(ctx, msgs)
	}
	for from := 0; from < len(msgs); from += n {
		err := o.processBatch(ctx, msgs[from:min(from+n, len(msgs))])
		var me *inbox.MessageError
		if errors.As(err, &me) && me.Index >= 0 {
			// The chunks before committed; the consumer applies them again as duplicates.
			return &inbox.MessageError{Index: from + me.Index, Err: me.Err}
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// processBatch applies replies in one transaction of the engine (replyBatch) and, once it
// committed, counts and traces their transitions.
func (o *Orchestrator) processBatch(ctx context.Context, msgs []*message.Message) error {
	u := &replyBatch{o: o, b: &pgx.Batch{}}
	for i, msg := range msgs {
		if ref, key, ok := o.readReply(msg); ok {
			u.replies = append(u.replies, reply{i, msg, ref, key})
		}
	}
	if len(u.replies) == 0 {
		return nil
	}
	res, err := o.run.Run(ctx, len(msgs), u)
	o.settle(u, res, err)
	return err
}

// settle counts and traces the transitions of a transaction of replies once it committed,
// and logs and counts the replies it parked; it ends the replies' spans either way.
func (o *Orchestrator) settle(u *replyBatch, res engine.Result, err error) {
	committed := err == nil && res.Outcome == engine.Applied
	for _, d := range u.done {
		if committed {
			o.observe(d.in, d.fx, u.now)
			noteTransition(d.ctx, d.in, d.fx)
		}
		endMessage(d.span, err)
	}
	if committed {
		for _, p := range u.parked {
			o.noteParked(p)
		}
	}
}

// reply is one readable reply of a batch.
type reply struct {
	index int
	msg   *message.Message
	ref   outbox.SagaRef
	key   string
}

// replyBatch is the orchestrator's part of a transaction of replies (engine.Unit).
type replyBatch struct {
	o       *Orchestrator
	replies []reply
	now     time.Time // the database's clock, read with the saga rows
	done    []transition
	b       *pgx.Batch // what Write sends: timers, saga rows
	// commands are the transitions' commands; origin[i] is the index in the batch of the
	// reply whose transition sent commands[i].
	commands []*message.Message
	origin   []int
	// parked are the replies this transaction parks (parked.go): their saga's definition
	// version is not registered here, or the saga has parked replies already.
	parked []parkedReply
	// redrive is set when the replies are parked ones, claimed from saga_parked by the
	// re-drive (parked.go) rather than handed over by a consumer.
	redrive *redrive
}

// transition is a reply's computed transition, traced and counted once it committed.
type transition struct {
	ctx  context.Context
	in   *instance
	fx   *effects
	span trace.Span
}

// Apply implements engine.Unit: the replies' dedup keys claimed and their sagas locked in one
// round trip, then each new reply's transition computed (and run: OnReplyTx, local steps) on
// its saga's row in memory, replies of one saga in order. A reply of a saga whose definition
// version is not registered here, or that has parked replies, is parked (parked.go). A
// re-drive's replies are claimed from saga_parked instead, and deleted there.
func (u *replyBatch) Apply(ctx context.Context, tx pgx.Tx) ([]int, error) {
	o := u.o
	claim := u.claimAndLock
	if u.redrive != nil {
		claim = u.claimParked
	}
	fresh, lk, err := claim(ctx, tx)
	if err != nil || len(fresh) == 0 {
		return nil, err // every reply was a duplicate (or none is parked): nothing to commit
	}
	if u.now = lk.now; len(lk.sagas) == 0 { // no row read, so no clock: none is needed either
		u.now = time.Now()
	}
	applied := make([]int, 0, len(fresh))
	var changed []*instance // in the order first changed
	for _, r := range fresh {
		if err := lk.broken[r.ref.ID]; err != nil {
			return nil, &inbox.MessageError{Index: r.index, Err: err}
		}
		applied = append(applied, r.index) // its dedup row commits, whatever follows
		in := lk.sagas[r.ref.ID]
		if in == nil {
			o.cfg.Logger.Warn("saga: reply for an unknown saga acknowledged", "saga_id", r.ref.ID)
			o.cfg.Metrics.Ignored("")
			continue
		}
		def, err := o.lookup(in.Name, in.Version)
		if err != nil || lk.parked[in.ID] {
			// Not the reply's fault: parked, in this transaction, for an orchestrator that has
			// the version; and once a reply of a saga parks, its later ones park behind it.
			u.park(r, in, err != nil)
			lk.parked[in.ID] = true
			continue
		}
		if u.redrive != nil {
			u.redrive.drain = append(u.redrive.drain, r)
		}
		mctx, span := startMessage(o.tr, r.msg, r.ref, o.cfg.Consumer)
		fx, err := o.advance(mctx, tx, def, in, u.now, replyOf(r.msg, r.ref))
		if err != nil {
			endMessage(span, err)
			// An OnReplyTx handler's or a local step's deadlock, a lost connection: the
			// transaction's failure; anything else the reply's.
			return nil, engine.Blame(ctx, err, tx.Conn(), r.index)
		}
		u.done = append(u.done, transition{mctx, in, fx, span})
		if fx.stale != "" {
			continue
		}
		if !slices.Contains(changed, in) {
			changed = append(changed, in)
		}
		o.st.queueTimers(u.b, in.ID, fx, nil)
		for _, cmd := range fx.commands {
			cmd.SetContext(mctx) // its `create` span continues the reply's trace
			u.commands = append(u.commands, cmd)
			u.origin = append(u.origin, r.index)
		}
	}
	for _, in := range changed {
		if err := o.st.queueUpdate(u.b, in); err != nil {
			return nil, err
		}
	}
	if rd := u.redrive; rd != nil && len(rd.drain) > 0 {
		ids, keys := make([]string, len(rd.drain)), make([]string, len(rd.drain))
		for i, r := range rd.drain {
			ids[i], keys[i] = r.ref.ID, r.key
		}
		u.b.Queue(o.st.park.drain, ids, keys)
	}
	return applied, nil
}

// claimAndLock claims the replies' dedup keys and locks their sagas, in one statement each
// and one round trip, and returns the new replies. The sagas of duplicate replies are locked
// for nothing; the transaction's end releases them.
func (u *replyBatch) claimAndLock(ctx context.Context, tx pgx.Tx) ([]reply, locked, error) {
	keys := make([]string, len(u.replies))
	ids := make([]string, len(u.replies))
	for i, r := range u.replies {
		keys[i], ids[i] = r.key, r.ref.ID
	}
	slices.Sort(ids)
	var claimed []bool
	var lk locked
	b := &pgx.Batch{}
	if err := u.o.run.QueueClaim(b, keys, &claimed); err != nil {
		return nil, lk, err
	}
	ids = slices.Compact(ids)
	u.o.st.queueLockMany(b, ids, &lk)
	// Read after the sagas are locked (a statement of its own, so with a snapshot taken
	// then): a reply parks only under its saga's lock, so no parked reply is missed.
	lk.parked = map[string]bool{}
	b.Queue(u.o.st.park.among, ids).Query(func(rows pgx.Rows) error {
		var id string
		_, err := pgx.ForEachRow(rows, []any{&id}, func() error { lk.parked[id] = true; return nil })
		return err
	})
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, lk, fmt.Errorf("saga: claim %d replies and lock their sagas: %w", len(keys), u.o.st.explain(err))
	}
	fresh := u.replies[:0:0]
	for j, r := range u.replies {
		if !claimed[j] {
			u.o.cfg.Logger.Debug("saga: duplicate reply skipped", "saga_id", r.ref.ID, "dedup_key", r.key)
			continue
		}
		fresh = append(fresh, r)
	}
	return fresh, lk, nil
}

// Write implements engine.Unit: the timers, the saga rows and every command, in one round trip.
func (u *replyBatch) Write(ctx context.Context, tx pgx.Tx) error {
	if len(u.commands) > 0 {
		if err := u.o.cfg.Writer.QueueWriteTx(ctx, u.b, "", u.commands...); err != nil {
			return engine.Refused(fmt.Errorf("saga: write %d commands: %w", len(u.commands), u.o.st.explain(err)), u.origin)
		}
	}
	if u.b.Len() == 0 {
		return nil
	}
	if err := tx.SendBatch(ctx, u.b).Close(); err != nil {
		return fmt.Errorf("saga: store the transitions of %d replies: %w", len(u.done), u.o.st.explain(err))
	}
	return nil
}

// readReply reads a reply's saga reference and dedup key. A message that is not a reply this
// orchestrator can read is logged, counted as ignored and dropped: retrying cannot fix it.
func (o *Orchestrator) readReply(msg *message.Message) (outbox.SagaRef, string, bool) {
	ref, isSaga, err := outbox.SagaOf(msg)
	if err != nil || !isSaga {
		o.cfg.Logger.Warn("saga: message on a reply topic without valid saga metadata; acknowledged and dropped",
			"message_uuid", msg.UUID, "err", err)
		o.cfg.Metrics.Ignored(msg.Metadata.Get(outbox.MetadataSagaName))
		return ref, "", false
	}
	key, err := inbox.SagaKey(ref)
	if err != nil {
		o.cfg.Metrics.Ignored(msg.Metadata.Get(outbox.MetadataSagaName))
		o.cfg.Logger.Warn("saga: reply without a usable key; dropped", "message_uuid", msg.UUID, "err", err)
		return ref, "", false
	}
	return ref, key, true
}

func replyOf(msg *message.Message, ref outbox.SagaRef) event {
	// An unreadable wait is no wait: the step's backoff applies.
	after, _ := time.ParseDuration(msg.Metadata.Get(outbox.MetadataSagaRetryAfter))
	return event{reply: &replyEvent{EventID: msg.UUID, Step: ref.Step, Phase: ref.Phase, Attempt: ref.Attempt,
		Outcome: msg.Metadata.Get(outbox.MetadataSagaOutcome), Reason: msg.Metadata.Get(outbox.MetadataSagaReason), Payload: msg.Payload,
		RetryAfter: max(after, 0)}}
}

// SettlePoison gives up a reply whose transition kept failing: in one transaction its dedup
// row and poison row (`onceflow inbox poison`) are written and its saga is set stuck with the
// error (`onceflow saga show` shows it; `onceflow saga retry` resumes it once the cause is
// fixed), so the reply partition moves on.
func (o *Orchestrator) SettlePoison(ctx context.Context, msg *message.Message, g inbox.GiveUp) error {
	ref, isSaga, _ := outbox.SagaOf(msg)
	key, _ := inbox.DefaultKey(msg)
	// A replay of the reply would apply an old reply to a saga that may have moved on
	// (`saga retry` re-sends the step with a new attempt): refused, with the way out.
	g.NoReplay = "a saga reply: its saga was set stuck when it was given up; resume the saga with `onceflow saga retry " + ref.ID +
		"` (a replay would apply an old reply to a saga that may have moved on)"
	var name string
	var settled bool
	err := o.run.InTx(ctx, func(ctx context.Context, tx pgx.Tx) (err error) {
		// A reply that another delivery applied meanwhile (its commit went through as the
		// connection dropped) is not given up, and its saga is not stuck.
		if settled, err = o.run.GiveUpTx(ctx, tx, msg, key, g); err != nil || !settled || !isSaga {
			return err
		}
		if ref.Phase == outbox.SagaPhaseAction && msg.Metadata.Get(outbox.MetadataSagaOutcome) == outbox.SagaOutcomeDone {
			// The participant says the action took effect: a retry's command will say so, so
			// that the action never runs again, whatever the participant's records hold then.
			if _, err := tx.Exec(ctx, o.st.tookEffect, ref.ID, ref.Step); err != nil {
				return err
			}
		}
		reason := fmt.Sprintf("the %s reply of step %q (attempt %d) could not be applied after %d tries: %v", ref.Phase, ref.Step, ref.Attempt, g.Attempts, g.Err)
		err = tx.QueryRow(ctx, o.st.stuck, ref.ID, reason).Scan(&name)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil // unknown or finished: nothing to stop
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("saga: settle reply %q: %w", msg.UUID, o.st.explain(err))
	}
	if !settled {
		return nil
	}
	o.run.LogGiveUp(msg, g)
	if name != "" {
		o.cfg.Metrics.Stuck(name)
		o.cfg.Logger.Error("saga: stuck: a reply could not be applied; resume it with `onceflow saga retry` once the cause is fixed",
			"saga_id", ref.ID, "saga", name, "step", ref.Step, "err", g.Err)
	}
	return nil
}

// ActionProcessor is Action for inboxkafka.BatchConsumer: the commands of a batch run in one
// transaction, their dedup keys and barrier keys each claimed in one statement and their
// replies written in one outbox statement. A command whose handler fails with an ordinary
// error is retried by the consumer (BatchConfig.MaxAttempts) and then answered as a failed
// attempt carrying the error (SettlePoison).
func ActionProcessor[C, R any](p *Participant, h func(ctx context.Context, tx pgx.Tx, cmd C) (R, error)) inbox.BatchProcessor {
	return &stepProcessor{p: p, phase: outbox.SagaPhaseAction, run: actionRun(h)}
}

// CompensationProcessor is Compensation for inboxkafka.BatchConsumer; see ActionProcessor.
func CompensationProcessor[C any](p *Participant, h func(ctx context.Context, tx pgx.Tx, cmd C) error) inbox.BatchProcessor {
	return &stepProcessor{p: p, phase: outbox.SagaPhaseCompensation, run: compensationRun(h)}
}

// CompensationForProcessor is CompensationFor for inboxkafka.BatchConsumer.
func CompensationForProcessor[C, R any](p *Participant, h func(ctx context.Context, tx pgx.Tx, cmd C, done *R) error) inbox.BatchProcessor {
	return &stepProcessor{p: p, phase: outbox.SagaPhaseCompensation, run: compensationForRun(h)}
}

// stepRun decodes a command and runs the step's handler on it, returning the reply payload.
// actionResult is, for a compensation, the result its action kept with its barrier row.
type stepRun func(ctx context.Context, tx pgx.Tx, msg *message.Message, actionResult []byte) ([]byte, error)

type stepProcessor struct {
	p     *Participant
	phase outbox.SagaPhase
	run   stepRun
}

// command is one saga command of a batch.
type command struct {
	index   int
	msg     *message.Message
	ref     outbox.SagaRef
	replyTo string
	key     string
	// outcome, once a handler returned Fail or Retry: the batch is run again without
	// running this handler, and the command is answered with it.
	outcome *outcomeError
}

// ProcessBatch implements inbox.BatchProcessor.
func (sp *stepProcessor) ProcessBatch(ctx context.Context, msgs []*message.Message) error {
	cmds := make([]*command, len(msgs))
	for i, msg := range msgs {
		ref, replyTo, key, err := sp.p.readCommand(msg, sp.phase)
		if err != nil {
			return &inbox.MessageError{Index: i, Err: err}
		}
		cmds[i] = &command{index: i, msg: msg, ref: ref, replyTo: replyTo, key: key}
	}
	// A handler that returns Fail or Retry must leave no write behind, but its command's
	// dedup row and reply must commit. Without a savepoint per command, the batch is rolled
	// back and run again with that outcome decided: each such command costs one re-run.
	for {
		_, err := sp.p.run.Run(ctx, len(msgs), &commandBatch{p: sp.p, phase: sp.phase, cmds: cmds, run: sp.run})
		var d *decided
		if !errors.As(err, &d) {
			return err
		}
		cmds[d.index].outcome = d.outcome
	}
}

// CheckSchema is the participant's: the batched consumer calls it before it starts.
func (sp *stepProcessor) CheckSchema(ctx context.Context) error { return sp.p.CheckSchema(ctx) }

// SettlePoison answers a command whose handler kept failing as a failed attempt carrying the
// error (outcome retry: the orchestrator re-sends it within the step's attempts, then
// compensates), with its dedup row, in one transaction. A command that is not a valid saga
// command is recorded as poison (`onceflow inbox poison`).
func (sp *stepProcessor) SettlePoison(ctx context.Context, msg *message.Message, g inbox.GiveUp) error {
	return sp.p.settle(ctx, msg, sp.phase, g)
}

// readCommand checks a command's saga metadata; an error (wrapping inbox.ErrNoKey: poison,
// no retry can fix it) when it is not a command of this phase.
func (p *Participant) readCommand(msg *message.Message, phase outbox.SagaPhase) (ref outbox.SagaRef, replyTo, key string, err error) {
	ref, isSaga, err := outbox.SagaOf(msg)
	if err == nil && !isSaga {
		err = errors.New("no saga metadata")
	}
	replyTo = msg.Metadata.Get(outbox.MetadataSagaReplyTo)
	if err == nil && replyTo == "" {
		err = fmt.Errorf("metadata %q is empty", outbox.MetadataSagaReplyTo)
	}
	if err == nil && ref.Phase != phase {
		err = fmt.Errorf("a %s command reached the %s handler; subscribe each handler to its own topic", ref.Phase, phase)
	}
	if err != nil {
		return ref, "", "", fmt.Errorf("saga participant %q: message %q: %w: %w", p.cfg.Consumer, msg.UUID, inbox.ErrNoKey, err)
	}
	key, err = inbox.SagaKey(ref)
	return ref, replyTo, key, err
}

// reply builds the reply to a command, addressed to its reply topic.
func (p *Participant) reply(cmd *message.Message, ref outbox.SagaRef, replyTo, outcome, reason string, payload []byte) *message.Message {
	reply := outbox.SetPartitionKey(outbox.NewMessage(payload), ref.ID)
	outbox.SetSaga(reply, ref)
	reply.Metadata.Set(outbox.MetadataSagaName, cmd.Metadata.Get(outbox.MetadataSagaName))
	reply.Metadata.Set(outbox.MetadataSagaOutcome, outcome)
	if reason != "" {
		reply.Metadata.Set(outbox.MetadataSagaReason, reason)
	}
	return outbox.ToTopic(reply, replyTo)
}

// settle answers a command whose handler kept failing as a failed attempt (see
// stepProcessor.SettlePoison); an invalid command is recorded as poison.
func (p *Participant) settle(ctx context.Context, msg *message.Message, phase outbox.SagaPhase, g inbox.GiveUp) error {
	ref, replyTo, key, err := p.readCommand(msg, phase)
	if err != nil {
		// Not a valid command of this participant: a replay would fail the same way.
		id := ref.ID
		if id == "" {
			id = "<saga id>"
		}
		g.NoReplay = "a saga command that is not valid for its participant: a replay would fail the same way; fix the sender, then `onceflow saga retry " + id + "`"
		key, _ := inbox.DefaultKey(msg) // "" without a usable key: the poison row only
		var settled bool
		err := p.run.InTx(ctx, func(ctx context.Context, tx pgx.Tx) (err error) {
			settled, err = p.run.GiveUpTx(ctx, tx, msg, key, g)
			return err
		})
		if err != nil {
			return fmt.Errorf("saga participant %q: record poison command %q: %w", p.cfg.Consumer, msg.UUID, schemaError(p.cfg.Schema, err))
		}
		if settled {
			p.run.LogGiveUp(msg, g)
		}
		return nil
	}
	reason := fmt.Sprintf("handler failed %d times: %v", g.Attempts, g.Err)
	err = p.run.InTx(ctx, func(ctx context.Context, tx pgx.Tx) error {
		claimed, err := p.run.ClaimTx(ctx, tx, key)
		if err != nil || !claimed[0] {
			return err // a duplicate: the first delivery was answered
		}
		return p.cfg.Writer.WriteTx(ctx, tx, "", p.reply(msg, ref, replyTo, outbox.SagaOutcomeRetry, reason, []byte("{}")))
	})
	if err != nil {
		return fmt.Errorf("saga participant %q: answer command %q as failed: %w", p.cfg.Consumer, msg.UUID, schemaError(p.cfg.Schema, err))
	}
	p.cfg.Metrics.StepError(p.cfg.Consumer)
	p.cfg.Logger.Error("saga participant: a command's handler kept failing; answered as a failed attempt (the saga retries or compensates)",
		"consumer", p.cfg.Consumer, "saga_id", ref.ID, "step", ref.Step, "phase", ref.Phase, "attempt", ref.Attempt,
		"tries", g.Attempts, "err", g.Err)
	return nil
}
