package inbox

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/engine"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/routerctx"
	"github.com/onceflow/onceflow/outbox"
)

// The retry lane (docs/inbox.md, "The retry lane").
//
// A handler that fails for a reason that lasts minutes (a provider down) returns
// RetryAfter(err, d). Retrying in place would hold up every key of the partition; a retry
// topic would let the key's later messages overtake it. The lane does neither: the message is
// parked in inbox_parked (migration 0022) with its dedup row, in one transaction, and the
// partition moves on. Each transaction of the consumer asks, in the round trip of its dedup
// claim, whether its messages' lanes (consumer, topic, partition key) hold parked rows; a
// message whose lane does is parked behind them — its dedup row and parked row commit in that
// transaction, and its handler does not run. Other keys are applied as usual.
//
// When the head of a lane is due, a process of the consumer (Inbox.RouterPlugin, or a
// inboxkafka.BatchConsumer of its topic) applies it in a transaction that also deletes its
// parked row — exactly once, like a replay — and makes the next row of the lane due at once,
// so the lane drains in order. A head that asks for later again is parked again with its
// attempts counted; after Config.LaneMaxAttempts, or when it fails with another error after
// the consumer's attempts, it is given up as poison (inbox_poison, replayable like any other)
// and the lane goes on with its next message, as a partition goes on past a poison message.
//
// Races. The lane check locks the lane's last row (FOR KEY SHARE) and a drain locks the head it
// applies (FOR UPDATE): when the head is the last row, a drain that empties the lane and a
// transaction that parks behind it wait for each other, so a row is never parked behind a lane
// the drain has just emptied (it would have no due time) and a message never overtakes one
// still parked.

// DefaultLaneMaxAttempts is the default Config.LaneMaxAttempts.
const DefaultLaneMaxAttempts = 10

// DefaultLaneInterval is the default Config.LaneInterval.
const DefaultLaneInterval = time.Second

// drainBatch bounds the due heads one look reads.
const drainBatch = 100

// RetryLater is the error RetryAfter returns; see RetryAfter.
type RetryLater = engine.RetryLater

// RetryAfter returns err as a request to try the message again after d without holding up its
// partition: the retry lane. Return it from a handler (router or batched inbox) when the
// failure will last (a provider down, a rate limit's Retry-After):
//
//	if errors.Is(err, errProviderDown) {
//		return nil, inbox.RetryAfter(err, 10*time.Minute)
//	}
//
// The message is parked with its dedup row in one transaction and the partition's offset
// moves on; later messages of its key (outbox.PartitionKey, or Config.LaneKey) are parked
// behind it in order and other keys go on. When due it is applied by the consumer's own
// processes, exactly once; after Config.LaneMaxAttempts it is given up as poison. d is clamped
// to [100 ms, 7 days]. A router needs the Poison middleware (it parks the message) and
// Inbox.RouterPlugin (it applies the lane); Retry should not retry it (ShouldRetry).
func RetryAfter(err error, d time.Duration) error { return engine.NewRetryLater(err, d) }

// laneSQL holds the lane's statements.
type laneSQL struct {
	claimOne, check, behind, head, due, start, done, again string
}

func newLaneSQL(schema string) laneSQL {
	t := pgsql.Table(schema, "inbox_parked")
	cols := `consumer, topic, lane, dedup_key, message_uuid, source, handler, publish_topic, metadata, payload`
	return laneSQL{
		// One message's claim (the engine's claimOne) and its lane's check in one statement.
		claimOne: `WITH claim AS (INSERT INTO ` + pgsql.Table(schema, "processed_event") + ` (consumer, dedup_key) VALUES ($1, $2)
				ON CONFLICT DO NOTHING RETURNING 1),
			last AS (SELECT 1 FROM ` + t + ` WHERE consumer = $1 AND topic = $3 AND lane = $4 ORDER BY id DESC LIMIT 1 FOR KEY SHARE)
			SELECT EXISTS (SELECT 1 FROM claim), EXISTS (SELECT 1 FROM last)`,
		// The lanes of $2/$3 (topic, partition key) that hold parked rows, each through its last
		// row, locked against a drain that would empty the lane meanwhile. The one-time EXISTS
		// spares the probes while the consumer has nothing parked (almost always).
		check: `SELECT u.topic, u.lane FROM unnest($2::text[], $3::text[]) AS u(topic, lane)
			CROSS JOIN LATERAL (SELECT 1 FROM ` + t + ` p WHERE p.consumer = $1 AND p.topic = u.topic AND p.lane = u.lane
				ORDER BY p.id DESC LIMIT 1 FOR KEY SHARE) last
			WHERE EXISTS (SELECT 1 FROM ` + t + ` WHERE consumer = $1)`,
		// Messages parked behind their lane's rows, in the batch's order: no due time (the
		// drain makes each due when it becomes its lane's head).
		behind: `INSERT INTO ` + t + ` (` + cols + `)
			SELECT $1, u.topic, u.lane, u.k, u.id, u.src, u.h, u.pt, u.md, u.pl
			FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[], $9::jsonb[], $10::bytea[])
				WITH ORDINALITY AS u(topic, lane, k, id, src, h, pt, md, pl, ord)
			ORDER BY u.ord`,
		// A message its handler asked to retry later, as its lane's head: due after $13
		// seconds, unless its lane holds rows already (then it waits behind them).
		head: `WITH last AS (SELECT 1 FROM ` + t + ` WHERE consumer = $1 AND topic = $2 AND lane = $3
				ORDER BY id DESC LIMIT 1 FOR KEY SHARE)
			INSERT INTO ` + t + ` (` + cols + `, attempts, error, due_at)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12,
				CASE WHEN EXISTS (SELECT 1 FROM last) THEN NULL ELSE now() + make_interval(secs => $13) END)`,
		due: `SELECT id, topic, lane, dedup_key, message_uuid, source, handler, publish_topic, metadata, payload, attempts FROM ` + t + `
			WHERE consumer = $1 AND due_at <= now() AND (handler = ANY($2::text[]) OR (handler = '' AND topic = ANY($3::text[])))
			ORDER BY due_at, id LIMIT ` + strconv.Itoa(drainBatch),
		// Locks the head: two processes of the consumer that read it apply it once.
		start: `SELECT attempts FROM ` + t + ` WHERE id = $1 AND consumer = $2 AND due_at <= now() FOR UPDATE`,
		// The head leaves its lane (applied or given up); the next row of the lane is due now.
		done: `WITH gone AS (DELETE FROM ` + t + ` WHERE id = $1 AND consumer = $2 RETURNING consumer, topic, lane)
			UPDATE ` + t + ` p SET due_at = now()
			FROM gone g CROSS JOIN LATERAL (SELECT x.id FROM ` + t + ` x
				WHERE x.consumer = g.consumer AND x.topic = g.topic AND x.lane = g.lane AND x.id > $1 ORDER BY x.id LIMIT 1) nx
			WHERE p.id = nx.id`,
		again: `UPDATE ` + t + ` SET attempts = attempts + $3::int, error = $4::text, due_at = now() + make_interval(secs => $5)
			WHERE id = $1 AND consumer = $2`,
	}
}

// laneOf is msg's lane: its subscribe topic and its partition key ("" when it has none: it is
// parked alone and never waits behind another).
func (ib *Inbox) laneOf(msg *message.Message) (topic, lane string) {
	return message.SubscribeTopicFromCtx(msg.Context()), ib.cfg.LaneKey(msg)
}

// claimAndCheckLanes claims keys (those of msgs[keyed[i]]) and asks which of the messages' lanes
// hold parked rows (parked[topic+"\x00"+lane]), in one round trip: for one message with a lane,
// one statement (the path of the router's middleware, where a second statement cost about a
// tenth of its throughput); for more, the claim and the check pipelined.
func (ib *Inbox) claimAndCheckLanes(ctx context.Context, tx pgx.Tx, msgs []*message.Message, keys []string, keyed []int) (claimed []bool, parked map[string]bool, err error) {
	what := fmt.Sprintf("record %d dedup keys", len(keys))
	if len(keys) == 1 {
		topic, lane := ib.laneOf(msgs[keyed[0]])
		if lane == "" {
			claimed, err = ib.ClaimTx(ctx, tx, keys...)
			return claimed, nil, err
		}
		if _, err := engine.CheckKey(keys[0]); err != nil {
			return nil, nil, ib.dbError(what, err)
		}
		var fresh, inLane bool
		if err := tx.QueryRow(ctx, ib.laneSQL.claimOne, ib.cfg.Consumer, keys[0], topic, lane).Scan(&fresh, &inLane); err != nil {
			return nil, nil, ib.dbError(what, err)
		}
		if inLane {
			parked = map[string]bool{topic + "\x00" + lane: true}
		}
		return []bool{fresh}, parked, nil
	}
	b := &pgx.Batch{}
	if err := ib.run.QueueClaim(b, keys, &claimed); err != nil {
		return nil, nil, ib.dbError(what, err)
	}
	ib.queueLaneCheck(b, msgs, keyed, &parked)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, nil, ib.dbError(what, err)
	}
	return claimed, parked, nil
}

// queueLaneCheck queues, into b, the check of the lanes of msgs[idx...]: once b has run,
// (*parked)[topic+"\x00"+lane] is set for each lane that holds parked rows.
func (ib *Inbox) queueLaneCheck(b *pgx.Batch, msgs []*message.Message, idx []int, parked *map[string]bool) {
	topics, lanes := make([]string, 0, len(idx)), make([]string, 0, len(idx))
	seen := make(map[string]bool, len(idx))
	for _, i := range idx {
		topic, lane := ib.laneOf(msgs[i])
		if lane == "" || seen[topic+"\x00"+lane] {
			continue
		}
		seen[topic+"\x00"+lane] = true
		topics, lanes = append(topics, topic), append(lanes, lane)
	}
	if len(lanes) == 0 {
		return
	}
	b.Queue(ib.laneSQL.check, ib.cfg.Consumer, topics, lanes).Query(func(rows pgx.Rows) error {
		set := map[string]bool{}
		for rows.Next() {
			var topic, lane string
			if err := rows.Scan(&topic, &lane); err != nil {
				return err
			}
			set[topic+"\x00"+lane] = true
		}
		*parked = set
		return rows.Err()
	})
}

// parkBehind parks, in tx, the messages of fresh whose lane holds parked rows (parked), in
// order, and returns the others and the parked ones.
func (u *unit) parkBehind(ctx context.Context, tx pgx.Tx, fresh []int, parked map[string]bool) (run, behind []int, err error) {
	if len(parked) == 0 {
		return fresh, nil, nil
	}
	ib := u.ib
	var a parkArgs
	for _, i := range fresh {
		msg := u.msgs[i]
		topic, lane := ib.laneOf(msg)
		if lane == "" || !parked[topic+"\x00"+lane] {
			run = append(run, i)
			continue
		}
		if err := a.add(msg, topic, lane, u.keyOf(i)); err != nil {
			return nil, nil, err
		}
		behind = append(behind, i)
	}
	if len(behind) == 0 {
		return run, nil, nil
	}
	if _, err := tx.Exec(ctx, ib.laneSQL.behind, ib.cfg.Consumer, a.topic, a.lane, a.key, a.uuid, a.source, a.handler, a.publishTopic, a.md, a.payload); err != nil {
		return nil, nil, ib.dbError("park messages behind their lane", err)
	}
	for _, i := range behind {
		ib.cfg.Metrics.Parked(ib.cfg.Consumer)
		ib.endEarly(u.msgs[i], outcomeParked, nil)
	}
	ib.cfg.Logger.Debug("inbox: messages parked behind their key's parked message (retry lane)", "messages", len(behind))
	return run, behind, nil
}

// keyOf is the dedup key of msgs[i].
func (u *unit) keyOf(i int) string {
	for j, k := range u.keyed {
		if k == i {
			return u.keys[j]
		}
	}
	return ""
}

// parkArgs are the columns of parked messages, as arrays.
type parkArgs struct {
	topic, lane, key, uuid, source, handler, publishTopic []string
	md                                                    [][]byte
	payload                                               [][]byte
}

func (a *parkArgs) add(msg *message.Message, topic, lane, key string) error {
	md, err := json.Marshal(msg.Metadata)
	if err != nil {
		return fmt.Errorf("inbox: encode the metadata of message %q: %w", msg.UUID, err)
	}
	payload := msg.Payload
	if payload == nil {
		payload = []byte{}
	}
	ctx := msg.Context()
	a.topic, a.lane, a.key, a.uuid = append(a.topic, topic), append(a.lane, lane), append(a.key, key), append(a.uuid, msg.UUID)
	a.source = append(a.source, sourceOf(msg))
	a.handler = append(a.handler, message.HandlerNameFromCtx(ctx))
	a.publishTopic = append(a.publishTopic, message.PublishTopicFromCtx(ctx))
	a.md, a.payload = append(a.md, md), append(a.payload, payload)
	return nil
}

// originKey carries where a message came from, set by a batched consumer.
type originKey struct{}

type origin struct{ source, key string }

// WithOrigin returns ctx carrying where a message came from: its source (e.g.
// "topic/3@1234"), shown with its rows in the retry lane, and its Kafka key, its key in the
// lane when its metadata has no partition key (a message another producer sent).
// inboxkafka.BatchConsumer sets it on every message.
func WithOrigin(ctx context.Context, source, key string) context.Context {
	return context.WithValue(ctx, originKey{}, origin{source, key})
}

func originOf(msg *message.Message) origin {
	o, _ := msg.Context().Value(originKey{}).(origin)
	return o
}

// sourceOf is where msg came from: WithOrigin's, else its subscribe topic.
func sourceOf(msg *message.Message) string {
	if o := originOf(msg); o.source != "" {
		return o.source
	}
	return message.SubscribeTopicFromCtx(msg.Context())
}

// SettleLater parks msg at the head of its lane (engine.Parker): its dedup row and parked row
// commit in one transaction, due after l.After, so the consumer moves past it exactly once. A
// message whose dedup key another delivery recorded meanwhile is not parked.
func (ib *Inbox) SettleLater(ctx context.Context, msg *message.Message, l engine.Later) error {
	key, err := ib.key(msg)
	if err != nil {
		return engine.ErrNoLane // without a key it cannot be applied exactly once later: a failure as any
	}
	topic, lane := ib.laneOf(msg)
	var laneArg *string
	if lane != "" {
		laneArg = &lane
	}
	md, err := json.Marshal(msg.Metadata)
	if err != nil {
		return fmt.Errorf("inbox: encode the metadata of message %q: %w", msg.UUID, err)
	}
	payload := msg.Payload
	if payload == nil {
		payload = []byte{}
	}
	reason := "retry requested"
	if l.Err != nil {
		reason = l.Err.Error()
	}
	mctx := msg.Context()
	var parked bool
	err = ib.run.InTx(ctx, func(ctx context.Context, tx pgx.Tx) error {
		claimed, err := ib.run.ClaimTx(ctx, tx, key)
		if err != nil || !claimed[0] {
			return err // !claimed: another delivery of it committed meanwhile
		}
		if _, err := tx.Exec(ctx, ib.laneSQL.head, ib.cfg.Consumer, topic, laneArg, key, msg.UUID, l.Source,
			message.HandlerNameFromCtx(mctx), message.PublishTopicFromCtx(mctx), md, payload, max(l.Attempts, 1), reason, l.After.Seconds()); err != nil {
			return err
		}
		parked = true
		return nil
	})
	if err != nil {
		return ib.dbError(fmt.Sprintf("park message %q in the retry lane", msg.UUID), err)
	}
	if parked {
		ib.cfg.Metrics.Parked(ib.cfg.Consumer)
		ib.cfg.Logger.Warn("inbox: message parked in the retry lane; its partition goes on, later messages of its key wait behind it (`onceflow inbox parked` lists them)",
			"message_uuid", msg.UUID, "source", l.Source, "lane", lane, "retry_in", l.After, "attempts", max(l.Attempts, 1), "err", l.Err)
	}
	return nil
}

// SettleLater implements engine.Parker: the batch's processor parks in its inbox's lane.
func (p *batchProcessor) SettleLater(ctx context.Context, msg *message.Message, l engine.Later) error {
	return p.ib.SettleLater(ctx, msg, l)
}

// laneRow is a due head of a lane.
type laneRow struct {
	id                                                    int64
	topic, key, uuid, source, handler, publishTopic, lane string
	metadata                                              map[string]string
	payload                                               []byte
	attempts                                              int
}

// dueHeads reads up to drainBatch due heads of this consumer's lanes: those of the given router
// handlers, or of a batched consumer of the given topics.
func (ib *Inbox) dueHeads(ctx context.Context, handlers, topics []string) ([]*laneRow, error) {
	rows, err := ib.cfg.Pool.Query(ctx, ib.laneSQL.due, ib.cfg.Consumer, handlers, topics)
	if err != nil {
		return nil, ib.dbError("read the retry lane's due messages", err)
	}
	var out []*laneRow
	for rows.Next() {
		r := &laneRow{}
		var md []byte
		var lane *string
		if err := rows.Scan(&r.id, &r.topic, &lane, &r.key, &r.uuid, &r.source, &r.handler, &r.publishTopic, &md, &r.payload, &r.attempts); err != nil {
			rows.Close()
			return nil, ib.dbError("read the retry lane's due messages", err)
		}
		if lane != nil {
			r.lane = *lane
		}
		if err := json.Unmarshal(md, &r.metadata); err != nil {
			rows.Close()
			return nil, fmt.Errorf("inbox: consumer %q: parked row %d: decode its metadata: %w", ib.cfg.Consumer, r.id, err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, ib.dbError("read the retry lane's due messages", err)
	}
	return out, nil
}

// drainLanes applies the due heads of this consumer's lanes — of the given router handlers, or
// parked by a batched consumer of the given topics — each through rp like a failing message,
// and goes on while heads are due (an applied head makes its lane's next row due at once). It
// returns how many it applied, and stops early only when ctx ends or the schema is not
// migrated.
func (ib *Inbox) drainLanes(ctx context.Context, rp engine.RetryPolicy, handlers, topics []string, target func(handler, publishTopic string) replayTarget) (int, error) {
	applied := 0
	rp.Replaying = true
	for {
		rows, err := ib.dueHeads(ctx, handlers, topics)
		if err != nil || len(rows) == 0 {
			return applied, err
		}
		progress := false
		for _, row := range rows {
			msg := message.NewMessage(row.uuid, row.payload)
			if row.metadata != nil {
				msg.Metadata = row.metadata
			}
			msg.SetContext(routerctx.With(WithOrigin(ctx, row.source, row.lane), routerctx.Values{Handler: row.handler, SubscribeTopic: row.topic, PublishTopic: row.publishTopic}))
			p := &laneProc{ib: ib, row: row, target: target(row.handler, row.publishTopic)}
			if err := rp.ApplyOne(ctx, p, msg, row.source, nil); err != nil {
				return applied, err
			}
			if p.outcome == engine.Applied {
				applied++
				progress = true
			}
			progress = progress || p.settled
		}
		if !progress {
			return applied, nil // every head was taken by another process
		}
	}
}

// laneProc is the drain of one head as a BatchProcessor, for RetryPolicy.ApplyOne.
type laneProc struct {
	ib      *Inbox
	row     *laneRow
	target  replayTarget
	outcome engine.Outcome // of the attempt that applied it
	settled bool           // parked again or given up
}

func (p *laneProc) ProcessBatch(ctx context.Context, msgs []*message.Message) error {
	u := &unit{ib: p.ib, msgs: msgs, topic: p.target.topic, h: p.target.h, set: p.target.set, keys: []string{p.row.key}, keyed: []int{0}, claimed: true}
	res, err := p.ib.runUnit(ctx, u, &laneUnit{unit: u, row: p.row})
	p.outcome = res.Outcome
	return err
}

// SettleLater parks the head again, with its attempts counted, or gives it up once they reach
// Config.LaneMaxAttempts.
func (p *laneProc) SettleLater(ctx context.Context, msg *message.Message, l engine.Later) error {
	attempts := p.row.attempts + max(l.Attempts, 1)
	if attempts >= p.ib.cfg.LaneMaxAttempts {
		return p.giveUp(ctx, msg, engine.GiveUp{Source: p.row.source, Attempts: attempts,
			Err: fmt.Errorf("given up in the retry lane after %d attempts (LaneMaxAttempts): %w", attempts, l.Err)})
	}
	reason := "retry requested"
	if l.Err != nil {
		reason = l.Err.Error()
	}
	if _, err := p.ib.cfg.Pool.Exec(ctx, p.ib.laneSQL.again, p.row.id, p.ib.cfg.Consumer, max(l.Attempts, 1), reason, l.After.Seconds()); err != nil {
		return p.ib.dbError(fmt.Sprintf("park message %q again", msg.UUID), err)
	}
	p.settled = true
	p.ib.cfg.Logger.Warn("inbox: a parked message asked for later again; it stays at the head of its lane",
		"message_uuid", msg.UUID, "source", p.row.source, "lane", p.row.lane, "retry_in", l.After, "attempts", attempts, "err", l.Err)
	return nil
}

// SettlePoison gives the head up after the consumer's attempts failed with another error.
func (p *laneProc) SettlePoison(ctx context.Context, msg *message.Message, g GiveUp) error {
	g.Attempts += p.row.attempts
	return p.giveUp(ctx, msg, g)
}

// giveUp records the head as poison (its dedup row stays, as for any poison message), removes it
// from its lane and makes the lane's next row due: the lane goes on past it.
func (p *laneProc) giveUp(ctx context.Context, msg *message.Message, g GiveUp) error {
	ib := p.ib
	g.Handler, g.PublishTopic = p.row.handler, p.row.publishTopic
	err := ib.run.InTx(ctx, func(ctx context.Context, tx pgx.Tx) error {
		if err := ib.run.RecordPoisonTx(ctx, tx, msg, p.row.key, g); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, ib.laneSQL.done, p.row.id, ib.cfg.Consumer)
		return err
	})
	if err != nil {
		return ib.dbError(fmt.Sprintf("give parked message %q up", msg.UUID), err)
	}
	p.settled = true
	ib.cfg.Metrics.Poisoned(ib.cfg.Consumer)
	ib.run.LogGiveUp(msg, g)
	return nil
}

// laneUnit applies a due head: the consumer's unit (its key is claimed already: it was claimed
// when the message was parked) with the head locked first and, in the same transaction, its
// row deleted and its lane's next row made due.
type laneUnit struct {
	*unit
	row *laneRow
}

// Start implements engine.Starter: false when the row is no longer a due head (another process
// applied it, or it was parked again).
func (l *laneUnit) Start(ctx context.Context, tx pgx.Tx) (bool, error) {
	var attempts int
	err := tx.QueryRow(ctx, l.ib.laneSQL.start, l.row.id, l.ib.cfg.Consumer).Scan(&attempts)
	if err == pgx.ErrNoRows {
		return false, nil
	}
	if err != nil {
		return false, l.ib.dbError(fmt.Sprintf("start parked row %d", l.row.id), err)
	}
	l.row.attempts = attempts
	return true, nil
}

// Write implements engine.Unit: the handler's messages and the head out of its lane.
func (l *laneUnit) Write(ctx context.Context, tx pgx.Tx) error {
	if err := l.unit.Write(ctx, tx); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, l.ib.laneSQL.done, l.row.id, l.ib.cfg.Consumer); err != nil {
		return l.ib.dbError(fmt.Sprintf("remove parked row %d", l.row.id), err)
	}
	return nil
}

var _ engine.LaneDrainer = (*batchProcessor)(nil)

// DrainLanes implements engine.LaneDrainer: the due messages a batched consumer of topics
// parked run through this processor's handler.
func (p *batchProcessor) DrainLanes(ctx context.Context, rp engine.RetryPolicy, topics []string) (int, error) {
	return p.ib.drainLanes(ctx, rp, nil, topics, func(string, string) replayTarget {
		return replayTarget{topic: p.topic, h: p.perMessage, set: p.set}
	})
}

// LaneInterval implements engine.LaneDrainer.
func (p *batchProcessor) LaneInterval() time.Duration { return p.ib.cfg.LaneInterval }

// defaultLaneKey is Config.LaneKey's default: the partition key the relay published the
// message with, else its Kafka key when a batched consumer said it (WithOrigin).
func defaultLaneKey(msg *message.Message) string {
	if k := outbox.PartitionKey(msg); k != "" {
		return k
	}
	return originOf(msg).key
}
