package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/audit"
	"github.com/onceflow/onceflow/internal/engine"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/routerctx"
)

// Replay of given-up messages (`onceflow inbox poison replay`, the console's replay button).
//
// The mechanism: a request is a state change of the poison row (poison → replay_requested),
// and the consumer's own processes apply it in their own transaction, with their own engine
// (processBatch with a batch of one): the row is marked replayed, the message's dedup row is
// removed, the key is claimed again and the handler runs — one commit. So the message is
// re-driven through its own consumer exactly once, with its original id, payload and metadata,
// and never reaches the topic's other consumer groups (a re-publish to the topic would, and
// they would apply it again once their dedup rows expired). A second request of the same row
// finds it in another state and is refused. See docs/inbox.md, "Replaying given-up messages".

// Poison row states (inbox_poison.state).
const (
	// StatePoison: given up; its dedup row makes a redelivery a duplicate.
	StatePoison = "poison"
	// StateReplayRequested: a replay waits for a process of the row's consumer.
	StateReplayRequested = "replay_requested"
	// StateReplayed: the replay was applied; a second one is refused.
	StateReplayed = "replayed"
	// StateDuplicate: when the replay ran, the message's dedup key was recorded by another
	// delivery that committed meanwhile, so the handler did not run again; a second replay is
	// refused.
	StateDuplicate = "duplicate"
)

// Replay bounds.
const (
	// DefaultReplayLimit is ReplayFilter.Limit's default: the rows one request covers.
	DefaultReplayLimit = 1000
	// MaxReplayLimit is the largest ReplayFilter.Limit.
	MaxReplayLimit = 10_000
	// pendingBatch bounds the requests a consumer reads per look.
	pendingBatch = 100
)

// ErrNoPoisonRow is wrapped by ReplayTx's error when no poison row matches the request (or an
// id names no row): nothing was requested.
var ErrNoPoisonRow = errors.New("no poison row matches")

// ErrReplayRefused is wrapped by ReplayTx's error when every matching row is refused (or, for
// a request by ids, any of them is): nothing was requested. ReplayResult.Refused says why.
var ErrReplayRefused = errors.New("replay refused")

// ReplayFilter selects the poison rows of a replay request. IDs name rows; Consumer, Since and
// ErrorContains select given-up rows (state poison) and combine with AND (with IDs too);
// without any of them All must be set.
type ReplayFilter struct {
	// IDs are inbox_poison ids. Every one must exist and be replayable, or nothing is
	// requested.
	IDs []int64
	// Consumer selects one consumer's rows (inbox.Config.Consumer).
	Consumer string
	// Since selects the rows given up at or after it.
	Since time.Time
	// ErrorContains selects the rows whose last error contains it (case-insensitive).
	ErrorContains string
	// All selects every given-up row; required when no other field selects.
	All bool
	// Limit bounds the rows one request covers, oldest first: 0 means DefaultReplayLimit, at
	// most MaxReplayLimit. ReplayResult.More says when more matched: request again.
	Limit int
	// DryRun computes the result and changes nothing.
	DryRun bool
	// By names who asks (an operator, "cli:alice"); it is recorded with the request and in
	// the row's history. Default "unknown".
	By string
}

// ReplayResult is what a replay request did (or, in a dry run, would do).
type ReplayResult struct {
	// Requested are the ids now waiting for their consumers, ascending.
	Requested []int64
	// Refused are the matching rows no replay may apply, with the reason and what to do.
	Refused []ReplayRefusal
	// More: more rows matched than Limit; request again for the rest.
	More bool
}

// ReplayRefusal is a row a replay request refused.
type ReplayRefusal struct {
	ID       int64
	Consumer string
	Reason   string
}

func (f ReplayFilter) check() error {
	var problems []string
	for _, id := range f.IDs {
		if id < 1 {
			problems = append(problems, fmt.Sprintf("id %d is not a poison row id (ids start at 1)", id))
		}
	}
	if len(f.IDs) > MaxReplayLimit {
		problems = append(problems, fmt.Sprintf("%d ids; at most %d per request", len(f.IDs), MaxReplayLimit))
	}
	if f.Limit < 0 || f.Limit > MaxReplayLimit {
		problems = append(problems, fmt.Sprintf("Limit is %d; use 0 for the default (%d) or 1..%d", f.Limit, DefaultReplayLimit, MaxReplayLimit))
	}
	if !f.All && len(f.IDs) == 0 && f.Consumer == "" && f.Since.IsZero() && f.ErrorContains == "" {
		problems = append(problems, "nothing selected: name rows (ids), filter them (consumer, since, error text), or set All to replay every given-up row")
	}
	if len(problems) > 0 {
		return fmt.Errorf("inbox: replay: %s; nothing requested", strings.Join(problems, "; "))
	}
	return nil
}

// describe says what the filter selects, for the error that says it matched nothing.
func (f ReplayFilter) describe() string {
	return describePoison(f.IDs, f.Consumer, f.Since, f.ErrorContains, "all")
}

// describePoison says what a filter of poison rows selects (ReplayFilter, DeleteFilter), for
// errors and the audit trail; none when it selects everything.
func describePoison(ids []int64, consumer string, since time.Time, errorContains, none string) string {
	var parts []string
	if len(ids) > 0 {
		s := make([]string, len(ids))
		for i, id := range ids {
			s[i] = strconv.FormatInt(id, 10)
		}
		parts = append(parts, "id "+strings.Join(s, ","))
	}
	if consumer != "" {
		parts = append(parts, fmt.Sprintf("consumer %q", consumer))
	}
	if !since.IsZero() {
		parts = append(parts, "given up since "+since.UTC().Format(time.RFC3339))
	}
	if errorContains != "" {
		parts = append(parts, fmt.Sprintf("error containing %q", errorContains))
	}
	if len(parts) == 0 {
		return none
	}
	return strings.Join(parts, ", ")
}

// ReplayTx requests the replay of the poison rows f selects, in tx: each is set to
// replay_requested (the request and the state change commit with tx), and a process of its
// consumer then applies it exactly once (Inbox.RouterPlugin, inboxkafka.BatchConsumer).
//
// Refused — and reported in ReplayResult.Refused — are rows whose replay was requested or
// applied already (a second replay is refused), rows given up without a dedup key (a replay
// could not be exactly once), and rows the saga engine marked (a reply whose saga it set
// stuck: `onceflow saga retry` resumes the saga). A request by ids is all or nothing: an id
// that names no row (ErrNoPoisonRow) or a refused row (ErrReplayRefused) fails it, and nothing
// is requested. A request by filter requests what may be replayed and reports the rest; it
// fails when nothing matched (ErrNoPoisonRow) or everything was refused (ErrReplayRefused).
// With f.DryRun nothing changes and the result says what would be requested.
func (a *Admin) ReplayTx(ctx context.Context, tx pgx.Tx, f ReplayFilter) (ReplayResult, error) {
	var res ReplayResult
	if err := f.check(); err != nil {
		return res, err
	}
	if f.By == "" {
		f.By = "unknown"
	}
	f.IDs = slices.Compact(slices.Sorted(slices.Values(f.IDs)))
	limit := f.Limit
	if limit == 0 {
		limit = DefaultReplayLimit
	}
	if len(f.IDs) > 0 {
		limit = len(f.IDs)
	}
	var since *time.Time
	if !f.Since.IsZero() {
		since = &f.Since
	}
	lock := " FOR UPDATE"
	if f.DryRun {
		lock = ""
	}
	// A filter selects given-up rows only; ids name rows in any state, so that a second
	// replay of a row is refused with its reason rather than "no such row". Oldest first,
	// on inbox_poison_consumer_idx (consumer, id) with a consumer, the primary key without.
	rows, err := tx.Query(ctx, `SELECT id, consumer, state, dedup_key IS NULL, replay_refusal, replay_requested_at, coalesce(replay_requested_by, ''), replayed_at
		FROM `+a.poison+`
		WHERE (coalesce(cardinality($1::bigint[]), 0) = 0 OR id = ANY($1::bigint[]))
		  AND ($2::text = '' OR consumer = $2::text)
		  AND ($3::timestamptz IS NULL OR failed_at >= $3::timestamptz)
		  AND ($4::text = '' OR strpos(lower(error), lower($4::text)) > 0)
		  AND (coalesce(cardinality($1::bigint[]), 0) > 0 OR state = 'poison')
		ORDER BY id LIMIT $5`+lock, f.IDs, f.Consumer, since, f.ErrorContains, limit+1)
	if err != nil {
		return res, a.wrap("replay: read the poison rows", err)
	}
	type cand struct {
		id              int64
		consumer, state string
		noKey           bool
		refusal         *string
		requestedAt     *time.Time
		requestedBy     string
		replayedAt      *time.Time
	}
	var cands []cand
	for rows.Next() {
		var c cand
		if err := rows.Scan(&c.id, &c.consumer, &c.state, &c.noKey, &c.refusal, &c.requestedAt, &c.requestedBy, &c.replayedAt); err != nil {
			rows.Close()
			return res, a.wrap("replay: read the poison rows", err)
		}
		cands = append(cands, c)
	}
	if err := rows.Err(); err != nil {
		return res, a.wrap("replay: read the poison rows", err)
	}
	if len(cands) > limit {
		cands, res.More = cands[:limit], true
	}
	if len(f.IDs) > 0 && len(cands) < len(f.IDs) {
		var missing []string
		for _, id := range f.IDs {
			if !slices.ContainsFunc(cands, func(c cand) bool { return c.id == id }) {
				missing = append(missing, strconv.FormatInt(id, 10))
			}
		}
		of := ""
		if f.Consumer != "" || !f.Since.IsZero() || f.ErrorContains != "" {
			of = " matching the filter"
		}
		return res, fmt.Errorf("inbox: replay: %w: no poison row%s with id %s in schema %q; nothing requested (`onceflow inbox poison` lists them)",
			ErrNoPoisonRow, of, strings.Join(missing, ", "), a.schema)
	}
	if len(cands) == 0 {
		return res, fmt.Errorf("inbox: replay: %w %s in schema %q (rows whose replay was requested or applied are not given up any more: `onceflow inbox poison` shows their state); nothing requested",
			ErrNoPoisonRow, f.describe(), a.schema)
	}
	var ok []int64
	for _, c := range cands {
		var reason string
		switch {
		case c.state == StateReplayRequested:
			reason = fmt.Sprintf("its replay was requested already (%s by %s) and waits for a process of consumer %q", fmtTime(c.requestedAt), c.requestedBy, c.consumer)
		case c.state == StateReplayed:
			reason = fmt.Sprintf("it was replayed already (%s): a second replay is refused; delete the row once handled (`onceflow inbox poison delete --id %d`)", fmtTime(c.replayedAt), c.id)
		case c.state == StateDuplicate:
			reason = fmt.Sprintf("its replay found the message applied by another delivery, so its handler did not run again: nothing is left to replay; delete the row (`onceflow inbox poison delete --id %d`)", c.id)
		case c.refusal != nil:
			reason = *c.refusal
		case c.noKey:
			reason = "it was given up without a dedup key, so a replay could not be applied exactly once; fix the sender (or the consumer's KeyFunc) and send the message again"
		default:
			ok = append(ok, c.id)
			continue
		}
		res.Refused = append(res.Refused, ReplayRefusal{ID: c.id, Consumer: c.consumer, Reason: reason})
	}
	if len(res.Refused) > 0 && (len(f.IDs) > 0 || len(ok) == 0) {
		var why []string
		for _, r := range res.Refused {
			why = append(why, fmt.Sprintf("row %d (consumer %q): %s", r.ID, r.Consumer, r.Reason))
		}
		return res, fmt.Errorf("inbox: replay: %w: %s; nothing requested", ErrReplayRefused, strings.Join(why, "; "))
	}
	if f.DryRun {
		res.Requested = ok
		return res, nil
	}
	rows, err = tx.Query(ctx, `UPDATE `+a.poison+` SET state = 'replay_requested', replay_requested_at = now(), replay_requested_by = $2::text,
		history = history || jsonb_build_array(jsonb_build_object('at', now(), 'event', 'requested', 'by', $2::text))
		WHERE id = ANY($1::bigint[]) AND state = 'poison' RETURNING id`, ok, f.By)
	if err != nil {
		return res, a.wrap("replay: request the replays", err)
	}
	res.Requested, err = pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return res, a.wrap("replay: request the replays", err)
	}
	slices.Sort(res.Requested)
	if len(res.Requested) > 0 {
		targets := make([]string, len(res.Requested))
		for i, id := range res.Requested {
			targets[i] = strconv.FormatInt(id, 10)
		}
		outcome := fmt.Sprintf("replays requested: %d", len(res.Requested))
		if len(res.Refused) > 0 {
			outcome += fmt.Sprintf(", refused: %d", len(res.Refused))
		}
		if err := audit.RecordTx(audit.WithFilter(ctx, f.describe()), tx, a.schema, audit.InboxReplay, targets, outcome); err != nil {
			return res, a.wrap("replay: record the replay request", err)
		}
	}
	return res, nil
}

func fmtTime(t *time.Time) string {
	if t == nil {
		return "at an unknown time"
	}
	return "at " + t.UTC().Format(time.RFC3339)
}

// replaySQL holds the statements of the consumer's side of a replay.
type replaySQL struct {
	pending, start, undedup, duplicate, failed string
}

func newReplaySQL(schema string) replaySQL {
	t := pgsql.Table(schema, "inbox_poison")
	return replaySQL{
		// On the partial index inbox_poison_replay_idx: as cheap with no request as with many.
		// A router's requests are those of its handlers ($2); a batched consumer's those it
		// gave up itself: no handler, one of its topics ($3).
		pending: `SELECT id, dedup_key, message_uuid, source, metadata, payload, handler, publish_topic, topic FROM ` + t + `
			WHERE consumer = $1 AND state = 'replay_requested' AND dedup_key IS NOT NULL
			  AND (handler = ANY($2::text[]) OR (handler = '' AND topic = ANY($3::text[])))
			ORDER BY id LIMIT ` + strconv.Itoa(pendingBatch),
		// Locks the row: two processes of the consumer that read the same request apply it
		// once (the second finds it replayed, after the first committed).
		start: `UPDATE ` + t + ` SET state = 'replayed', replayed_at = now(), replays = replays + 1,
			history = history || jsonb_build_array(jsonb_build_object('at', now(), 'event', 'replayed'))
			WHERE id = $1 AND consumer = $2 AND state = 'replay_requested'`,
		// Only the dedup row written when the message was given up (or before): a row recorded
		// later is another delivery's — the first expired with the retention window and the
		// message came again and was applied — and stays, so the claim finds the key taken.
		undedup: `DELETE FROM ` + pgsql.Table(schema, "processed_event") + ` WHERE consumer = $1 AND dedup_key = $2
			AND processed_at <= (SELECT failed_at FROM ` + t + ` WHERE id = $3)`,
		// The start's change, corrected in the same transaction: the claim found the key taken.
		duplicate: `UPDATE ` + t + ` SET state = 'duplicate', replayed_at = NULL, replays = replays - 1,
			history = (history - (-1)) || jsonb_build_array(jsonb_build_object('at', now(), 'event', 'duplicate'))
			WHERE id = $1 AND consumer = $2 AND state = 'replayed'`,
		failed: `UPDATE ` + t + ` SET state = 'poison', attempts = attempts + $3::int, replays = replays + 1, error = $4::text, failed_at = now(),
			history = history || jsonb_build_array(jsonb_build_object('at', now(), 'event', 'failed', 'attempts', $3::int, 'error', $4::text))
			WHERE id = $1 AND consumer = $2 AND state = 'replay_requested'`,
	}
}

// replayRow is a poison row whose replay was requested.
type replayRow struct {
	id                                              int64
	key, uuid, source, handler, publishTopic, topic string
	metadata                                        map[string]string
	payload                                         []byte
}

// pendingReplays reads up to pendingBatch requests of this consumer, oldest first: those of
// the given router handlers, or those a batched consumer of the given topics gave up.
func (ib *Inbox) pendingReplays(ctx context.Context, handlers, topics []string) ([]*replayRow, error) {
	rows, err := ib.cfg.Pool.Query(ctx, ib.replaySQL.pending, ib.cfg.Consumer, handlers, topics)
	if err != nil {
		return nil, ib.dbError("read the replay requests", err)
	}
	var out []*replayRow
	for rows.Next() {
		r := &replayRow{}
		var md []byte
		if err := rows.Scan(&r.id, &r.key, &r.uuid, &r.source, &md, &r.payload, &r.handler, &r.publishTopic, &r.topic); err != nil {
			rows.Close()
			return nil, ib.dbError("read the replay requests", err)
		}
		if err := json.Unmarshal(md, &r.metadata); err != nil {
			rows.Close()
			return nil, fmt.Errorf("inbox: consumer %q: poison row %d: decode its metadata: %w", ib.cfg.Consumer, r.id, err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, ib.dbError("read the replay requests", err)
	}
	return out, nil
}

// replayTarget is what a replay runs: the consumer's handler, as its engine runs it.
type replayTarget struct {
	topic string
	h     message.HandlerFunc
	set   BatchHandlerFunc
}

// applyReplays applies the waiting replay requests of this consumer — of the given router
// handlers, or given up by a batched consumer of the given topics — each through rp like any
// failing message: attempts, backoff, and when they are spent the row is given up again. It
// returns how many were replayed, and stops early only when ctx ends or the schema is not
// migrated.
func (ib *Inbox) applyReplays(ctx context.Context, rp engine.RetryPolicy, handlers, topics []string, target func(*replayRow) replayTarget) (int, error) {
	rows, err := ib.pendingReplays(ctx, handlers, topics)
	if err != nil {
		return 0, err
	}
	replayed := 0
	rp.Replaying = true
	for _, row := range rows {
		msg := message.NewMessage(row.uuid, row.payload)
		if row.metadata != nil {
			msg.Metadata = row.metadata
		}
		// What the router (or the batched consumer) gives a live message.
		msg.SetContext(routerctx.With(ctx, routerctx.Values{Handler: row.handler, SubscribeTopic: row.topic, PublishTopic: row.publishTopic}))
		p := &replayProc{ib: ib, row: row, target: target(row)}
		if err := rp.ApplyOne(ctx, p, msg, row.source, nil); err != nil {
			return replayed, err
		}
		switch p.outcome {
		case engine.Applied:
			replayed++
			ib.cfg.Logger.Info("inbox: poison message replayed", "poison_id", row.id, "message_uuid", row.uuid, "source", row.source)
		case engine.Duplicate:
			ib.cfg.Logger.Warn("inbox: replay not applied: the message's dedup key was recorded by another delivery meanwhile, so its handler did not run again (row state duplicate)",
				"poison_id", row.id, "message_uuid", row.uuid, "source", row.source)
		}
	}
	return replayed, nil
}

// replayProc is the replay of one row as a BatchProcessor, for RetryPolicy.ApplyOne: its
// ProcessBatch runs the consumer's unit with the replay's steps around it (replayUnit), its
// SettlePoison gives the row up again.
type replayProc struct {
	ib      *Inbox
	row     *replayRow
	target  replayTarget
	outcome engine.Outcome // of the attempt that settled it
}

func (p *replayProc) ProcessBatch(ctx context.Context, msgs []*message.Message) error {
	// The key it was given up under: the replay removes exactly that dedup row, even if
	// KeyFunc changed since.
	u := &unit{ib: p.ib, msgs: msgs, topic: p.target.topic, h: p.target.h, set: p.target.set, keys: []string{p.row.key}, keyed: []int{0}, noLane: true}
	res, err := p.ib.runUnit(ctx, u, &replayUnit{unit: u, row: p.row})
	p.outcome = res.Outcome
	return err
}

// SettlePoison gives the replayed message up again: the row goes back to poison with its
// attempts, replays, error and history updated; its dedup row stayed (the failed attempts
// rolled back), so a redelivery is still skipped.
func (p *replayProc) SettlePoison(ctx context.Context, msg *message.Message, g GiveUp) error {
	reason := "unknown error"
	if g.Err != nil {
		reason = g.Err.Error()
	}
	tag, err := p.ib.cfg.Pool.Exec(ctx, p.ib.replaySQL.failed, p.row.id, p.ib.cfg.Consumer, g.Attempts, reason)
	if err != nil {
		return p.ib.dbError(fmt.Sprintf("give poison row %d up again", p.row.id), err)
	}
	if tag.RowsAffected() == 1 {
		p.ib.cfg.Metrics.Poisoned(p.ib.cfg.Consumer)
		p.ib.cfg.Logger.Error("inbox: a replayed message failed again; given up again (`onceflow inbox poison` shows its attempts and history)",
			"poison_id", p.row.id, "message_uuid", msg.UUID, "source", g.Source, "attempts", g.Attempts, "err", g.Err)
	}
	return nil
}

// replayUnit is a replay as the engine runs it: the consumer's unit with a first step — the
// row marked replayed (which locks it) and the message's dedup row removed, so the claim finds
// the key new and the handler runs once more — all committed together or not at all.
type replayUnit struct {
	*unit
	row     *replayRow
	applied bool
}

// Start implements engine.Starter: false when the row is no longer waiting (another process
// of the consumer applied it, or it was deleted).
func (r *replayUnit) Start(ctx context.Context, tx pgx.Tx) (bool, error) {
	ib := r.ib
	tag, err := tx.Exec(ctx, ib.replaySQL.start, r.row.id, ib.cfg.Consumer)
	if err != nil {
		return false, ib.dbError(fmt.Sprintf("start the replay of poison row %d", r.row.id), err)
	}
	if tag.RowsAffected() == 0 {
		return false, nil
	}
	if _, err := tx.Exec(ctx, ib.replaySQL.undedup, ib.cfg.Consumer, r.row.key, r.row.id); err != nil {
		return false, ib.dbError(fmt.Sprintf("remove the dedup row of poison row %d", r.row.id), err)
	}
	return true, nil
}

// Apply implements engine.Unit.
func (r *replayUnit) Apply(ctx context.Context, tx pgx.Tx) ([]int, error) {
	applied, err := r.unit.Apply(ctx, tx)
	r.applied = len(applied) > 0
	return applied, err
}

// Write implements engine.Unit: the handler's messages, or, when the claim found the key
// taken by a delivery that committed meanwhile, the row marked duplicate instead of replayed.
func (r *replayUnit) Write(ctx context.Context, tx pgx.Tx) error {
	if r.applied {
		return r.unit.Write(ctx, tx)
	}
	if _, err := tx.Exec(ctx, r.ib.replaySQL.duplicate, r.row.id, r.ib.cfg.Consumer); err != nil {
		return r.ib.dbError(fmt.Sprintf("mark poison row %d duplicate", r.row.id), err)
	}
	return nil
}

var _ engine.Replayer = (*batchProcessor)(nil)

// ApplyReplays implements engine.Replayer: the replays of the rows this processor's batched
// consumer (of topics) gave up run through this processor's handler, in the engine every batch
// of it runs in.
func (p *batchProcessor) ApplyReplays(ctx context.Context, rp engine.RetryPolicy, topics []string) (int, error) {
	return p.ib.applyReplays(ctx, rp, nil, topics, func(*replayRow) replayTarget {
		return replayTarget{topic: p.topic, h: p.perMessage, set: p.set}
	})
}

// ReplayInterval implements engine.Replayer.
func (p *batchProcessor) ReplayInterval() time.Duration { return p.ib.cfg.ReplayInterval }

// attemptsKey carries the Poison middleware's record of the passes through the inbox
// middleware in a message's context.
type attemptsKey struct{}

// attempts is what the inbox middleware tells the Poison middleware outside it: how many
// times the message went through it, and whether the last pass failed for the transaction's
// own reason (engine: not the message's, while the message's context was live) — the engine's
// verdict, so that Poison never judges an error by its type.
type attempts struct {
	n           atomic.Int32
	transaction atomic.Bool
}

// record counts a pass; transaction says it failed for the transaction's own reason. Safe on
// nil (the Poison middleware is not installed).
func (a *attempts) record(transaction bool) {
	if a == nil {
		return
	}
	a.n.Add(1)
	a.transaction.Store(transaction)
}

// Poison is the router's poison middleware for an inbox consumer, in place of Watermill's
// PoisonQueue: install it outermost (first added). When the chain below it (Retry, Timeout,
// Recoverer, the inbox) fails a message for good, it records the message in inbox_poison with
// its dedup row, in one transaction — with its attempts (each pass through the inbox
// middleware), its last error, its topic, and the handler it failed in — and acknowledges it,
// so the partition moves on exactly once and a redelivery is skipped. `onceflow inbox poison`
// lists it, and `onceflow inbox poison replay` re-drives it through this handler once its bug
// is fixed (RouterPlugin applies the request).
//
// Whose the failure is, is the engine's verdict on the last pass through the inbox, not a
// guess from the error's type: a failure of the transaction's own connection or server
// (unreachable, restarting, a deadlock that outlasted Retry), or the consumer stopping (the
// message's context cancelled), is not given up: the message is nacked and redelivered.
// Everything else the handler returned is the message's — an HTTP client's error, a deadline
// of middleware.Timeout, a decoder's io.EOF — and is given up. If the poison row cannot be
// written, the message is nacked too.
func (ib *Inbox) Poison(h message.HandlerFunc) message.HandlerFunc {
	// The router decorates handlers after its plugins ran, so RouterPlugin has registered by
	// now if it is installed.
	if !ib.routerReplays.Load() {
		ib.warnNoReplayer.Do(func() {
			ib.cfg.Logger.Warn("inbox: the Poison middleware is installed but not the replay plugin: replays of this consumer's poison rows, and messages parked in its retry lane (RetryAfter), will wait " +
				"(`onceflow status` reports them); add router.AddPlugin(ib.RouterPlugin)")
		})
	}
	return func(msg *message.Message) ([]*message.Message, error) {
		mctx := msg.Context()
		pass := &attempts{}
		msg.SetContext(context.WithValue(mctx, attemptsKey{}, pass))
		out, err := h(msg)
		if err == nil {
			return out, nil
		}
		// The consumer stops (the router's own context, not one a middleware cancelled), or the
		// transaction failed: not the message's; redelivered.
		if (pass.transaction.Load() || errors.Is(mctx.Err(), context.Canceled)) && !IsPoison(err) {
			return nil, err
		}
		g := GiveUp{Source: message.SubscribeTopicFromCtx(mctx), Attempts: max(1, int(pass.n.Load())), Err: err,
			Handler: message.HandlerNameFromCtx(mctx), PublishTopic: message.PublishTopicFromCtx(mctx)}
		// The message's context may be cancelled already (Timeout, a closing subscriber).
		ctx, cancel := context.WithTimeout(context.WithoutCancel(mctx), ib.cfg.CommitTimeout)
		defer cancel()
		if rl := engine.AsRetryLater(err); rl != nil && !IsPoison(err) {
			// The handler asked for later: parked in the retry lane, and acknowledged.
			l := engine.Later{Source: g.Source, Attempts: g.Attempts, Err: err, After: rl.After}
			if serr := ib.SettleLater(ctx, msg, l); serr == nil {
				return nil, nil
			} else if !errors.Is(serr, engine.ErrNoLane) {
				return nil, fmt.Errorf("inbox: consumer %q: message %q asked to be retried later and could not be parked, so it is redelivered (%v): %w",
					ib.cfg.Consumer, msg.UUID, serr, err)
			}
		}
		if serr := ib.SettlePoison(ctx, msg, g); serr != nil {
			return nil, fmt.Errorf("inbox: consumer %q: message %q failed for good and could not be recorded as poison, so it is redelivered (%v): %w",
				ib.cfg.Consumer, msg.UUID, serr, err)
		}
		return nil, nil // recorded: acknowledged
	}
}

// RouterPlugin is a Watermill router plugin (router.AddPlugin(ib.RouterPlugin)) that applies
// replay requests of this consumer's poison rows — those the Poison middleware recorded — for
// as long as the router runs: every Config.ReplayInterval it looks for requests, and runs each
// message through the handler it failed in (router.Handlers(), by the name in the row) on the
// inbox's engine, in one transaction with the replay's state change and its dedup row, with
// the consumers' retry defaults (engine.DefaultMaxAttempts tries, backoff from 100 ms) before
// giving it up again. Middleware of the router is not run for a replay (the inbox is
// innermost, so the handler is what it wrapped); the handler finds the handler name, subscribe
// topic and publish topic in the message's context, as for a live message. It stops when the
// router closes.
func (ib *Inbox) RouterPlugin(r *message.Router) error {
	handlers := r.Handlers() // before the handlers start: the map is not changing yet
	names := make([]string, 0, len(handlers))
	for name := range handlers {
		names = append(names, name)
	}
	ib.routerReplays.Store(true)
	go ib.runRouterReplays(r, handlers, names)
	return nil
}

func (ib *Inbox) runRouterReplays(r *message.Router, handlers map[string]message.HandlerFunc, names []string) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The router has no context to watch: poll its state (cheap, in memory).
	go func() {
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for range t.C {
			if r.IsClosed() {
				cancel()
				return
			}
		}
	}()
	select {
	case <-r.Running():
	case <-ctx.Done():
		return
	}
	rp := engine.NewRetryPolicy(0, 0, 0, ib.cfg.Logger)
	target := func(row *replayRow) replayTarget {
		return replayTarget{topic: row.publishTopic, h: handlers[row.handler]}
	}
	laneTarget := func(handler, publishTopic string) replayTarget {
		return replayTarget{topic: publishTopic, h: handlers[handler]}
	}
	// The retry lane drains on a loop of its own: its interval is shorter than the replays'.
	go engine.RunEvery(ctx, "draining the retry lane", ib.cfg.LaneInterval, ib.cfg.Logger, func(ctx context.Context) (int, error) {
		return ib.drainLanes(ctx, rp, names, nil, laneTarget)
	})
	engine.RunReplays(ctx, ib.cfg.ReplayInterval, ib.cfg.Logger, func(ctx context.Context) (int, error) {
		return ib.applyReplays(ctx, rp, names, nil, target)
	})
}
