package saga

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/outbox"
)

// Versions side by side (a rolling deploy: docs/sagas.md, "Rolling deploys: versions side by
// side"). Orchestrators with different registered versions of a definition share one consumer
// group, so a reply may reach an orchestrator that lacks its saga's version. That is never the
// reply's fault: it is parked in saga_parked (migration 0016), in the transaction of its
// batch, and an orchestrator that has the version applies it from there in its Run.
//
// The parked reply's dedup key is claimed when it parks, with the other replies of its batch
// (one statement, before the saga rows are read, so before anyone knows the saga's version).
// The key then means "taken care of: applied or parked", so a redelivery of the reply is a
// duplicate whichever it was, and the re-drive applies the parked reply without a dedup check:
// its row is deleted in the transaction that applies it, so it is applied once. (Not claiming
// it would need a second round trip, or an unclaim, in every batch, and a redelivery racing
// the re-drive could then apply the reply twice.)
//
// Order: a saga's replies are applied in the order they arrived. A reply of a saga that has
// parked replies parks too — even at an orchestrator that has the version — and so does every
// later reply of that saga in the same batch; the re-drive takes a saga's parked replies in
// arrival order (saga_parked.seq), with the saga row locked. So a parked reply is never
// overtaken by a newer one, at the cost of one TimerInterval for the replies that park behind
// it, only while a saga has parked replies. Whether a saga has them is read after its row is
// locked (every parking transaction holds that lock), so none can be missed.
//
// Timers wait too: an orchestrator claims only the timers of sagas whose version it has
// (store.claimTimers), so another one, that has it, fires them.

// parkedSQL holds the statements on saga_parked of one schema.
type parkedSQL struct {
	insert, among, claim, fail, remove, drain, count, byVersion string
}

func newParkedSQL(schema string) parkedSQL {
	parkedT, sagaT := pgsql.Table(schema, "saga_parked"), pgsql.Table(schema, "saga")
	return parkedSQL{
		// ON CONFLICT: the key was claimed in the same transaction, so the row is new unless
		// the dedup row was removed (retention, a replay) while the parked one stayed.
		insert: `INSERT INTO ` + parkedT + ` (saga_id, dedup_key, message_uuid, metadata, payload, name, version)
			VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (saga_id, dedup_key) DO NOTHING`,
		// Which of the sagas have parked replies: one primary-key probe per id, whatever plan
		// pgx's prepared statement got when the table was small.
		among: `SELECT u.id FROM unnest($1::text[]) AS u (id)
			WHERE EXISTS (SELECT 1 FROM ` + parkedT + ` p WHERE p.saga_id = u.id)`,
		// The parked replies of the registered versions ($1, $2), each with its saga row, both
		// locked or both skipped: a transaction that holds the saga (a reply, a timer, another
		// re-drive) keeps all of its parked replies for later, so a saga's replies are never
		// split between two re-drives. Never waits, so it cannot deadlock. Per version in
		// arrival order, on saga_parked_version_idx (a saga's replies all have its version, so
		// its order is kept): an orchestrator that lacks the parked versions reads a few
		// index pages, however many are parked (TestVersionClaimsStayOnTheirIndexes). $3 are sagas left out (their parked reply
		// failed in this round).
		claim: `SELECT p.saga_id, p.dedup_key, p.message_uuid, p.metadata, p.payload
			FROM unnest($1::text[], $2::int[]) AS r (name, version)
			CROSS JOIN LATERAL (SELECT p.saga_id, p.dedup_key, p.message_uuid, p.metadata, p.payload FROM ` + parkedT + ` p
				JOIN ` + sagaT + ` s ON s.id = p.saga_id
				WHERE p.name = r.name AND p.version = r.version AND p.saga_id <> ALL ($3::text[])
				ORDER BY p.seq LIMIT $4 FOR UPDATE OF p, s SKIP LOCKED) p
			LIMIT $4`,
		fail: `UPDATE ` + parkedT + ` SET attempts = attempts + 1, last_error = $3 WHERE saga_id = $1 AND dedup_key = $2
			RETURNING attempts`,
		remove: `DELETE FROM ` + parkedT + ` WHERE saga_id = $1 AND dedup_key = $2`,
		drain: `DELETE FROM ` + parkedT + ` p USING unnest($1::text[], $2::text[]) AS d (saga_id, dedup_key)
			WHERE p.saga_id = d.saga_id AND p.dedup_key = d.dedup_key`,
		count: `SELECT count(*)::int, min(parked_at), coalesce((SELECT last_error FROM ` + parkedT + `
			WHERE saga_id = $1 AND last_error IS NOT NULL ORDER BY seq LIMIT 1), '') FROM ` + parkedT + ` WHERE saga_id = $1`,
		byVersion: `SELECT name, version, count(*), count(DISTINCT saga_id), min(parked_at), now() FROM ` + parkedT + `
			GROUP BY name, version ORDER BY name, version`,
	}
}

// versions are the definitions registered with an orchestrator, as the two arrays the claims
// of parked replies and timers take.
type versions struct {
	names    []string
	versions []int32
}

// registered returns the registered definitions (Registered) as the claims' arrays.
func (o *Orchestrator) registered() versions {
	reg := o.Registered()
	v := versions{names: make([]string, len(reg)), versions: make([]int32, len(reg))}
	for i, d := range reg {
		v.names[i], v.versions[i] = d.Name, int32(d.Version)
	}
	return v
}

// round is one round of Run: the parked replies of the versions registered here, then the
// due timers. Parked replies go first: they arrived before the timers now due were looked at,
// and applying them first spares their sagas a timeout. Both run even when one fails (the
// saga_parked table missing from an unmigrated schema must not stop the timers).
func (o *Orchestrator) round(ctx context.Context) error {
	_, err := o.RedriveParked(ctx)
	if err != nil {
		err = fmt.Errorf("re-driving parked replies: %w", err)
	}
	if ferr := o.fireAll(ctx); ferr != nil {
		err = errors.Join(err, fmt.Errorf("firing due timers: %w", ferr))
	}
	return err
}

// parkedReply is a reply parked by this transaction.
type parkedReply struct {
	in *instance
	r  reply
	// lacking is set when this orchestrator lacks the saga's version; else the reply parked
	// behind the saga's earlier parked replies.
	lacking bool
}

// park queues the parking of reply r of saga in into the batch's writes. During a re-drive
// (whose replies are parked already) it keeps the row, which the re-drive then does not
// delete.
func (u *replyBatch) park(r reply, in *instance, lacking bool) {
	if u.redrive != nil {
		return
	}
	payload := []byte(r.msg.Payload)
	if payload == nil {
		payload = []byte{}
	}
	u.b.Queue(u.o.st.park.insert, in.ID, r.key, r.msg.UUID, map[string]string(r.msg.Metadata), payload, in.Name, in.Version)
	u.parked = append(u.parked, parkedReply{in: in, r: r, lacking: lacking})
}

// noteParked logs and counts a reply parked by a committed transaction.
func (o *Orchestrator) noteParked(p parkedReply) {
	args := []any{"saga_id", p.in.ID, "saga", p.in.Name, "version", p.in.Version, "step", p.r.ref.Step,
		"phase", p.r.ref.Phase, "attempt", p.r.ref.Attempt, "message_uuid", p.r.msg.UUID}
	if !p.lacking {
		o.cfg.Logger.Debug("saga: reply parked behind its saga's earlier parked replies; applied after them, in order, by this orchestrator's Run", args...)
		return
	}
	o.cfg.Metrics.AwaitingVersion(p.in.Name, p.in.Version)
	o.cfg.Logger.Warn(fmt.Sprintf("saga: reply parked: definition %q version %d is not registered with this orchestrator; "+
		"an orchestrator that has it applies the parked reply, in order — deploy one (or keep one running) with saga.Register of version %d "+
		"until `onceflow saga versions` shows none of its sagas unfinished", p.in.Name, p.in.Version, p.in.Version), args...)
}

// redrive is a transaction of parked replies (replyBatch.redrive): claimed from saga_parked
// rather than handed over by a consumer.
type redrive struct {
	v     versions
	skip  []string // sagas whose parked reply failed in this call
	limit int
	// drain are the parked rows the transaction applied (or found stale), deleted with it.
	drain []reply
}

// claimParked claims up to limit parked replies of the registered versions with their sagas
// (SKIP LOCKED), then reads the sagas: the re-drive's claimAndLock. The replies are not
// claimed in processed_event: their keys were when they parked.
func (u *replyBatch) claimParked(ctx context.Context, tx pgx.Tx) ([]reply, locked, error) {
	rd, st := u.redrive, u.o.st
	var lk locked
	rows, err := tx.Query(ctx, st.park.claim, rd.v.names, rd.v.versions, rd.skip, rd.limit)
	if err != nil {
		return nil, lk, fmt.Errorf("saga: claim parked replies: %w", st.explain(err))
	}
	var bad error
	var ids []string
	u.replies = u.replies[:0]
	for rows.Next() {
		var id, key, uuid string
		var md map[string]string
		var payload []byte
		if err := rows.Scan(&id, &key, &uuid, &md, &payload); err != nil {
			rows.Close()
			return nil, lk, fmt.Errorf("saga: claim parked replies: %w", st.explain(err))
		}
		msg := message.NewMessage(uuid, payload)
		msg.Metadata = md
		msg.SetContext(ctx)
		ref, _, err := outbox.SagaOf(msg)
		ref.ID = id
		if err != nil && bad == nil {
			// It was readable when it parked: only a row changed by hand gets here.
			bad = &inbox.MessageError{Index: len(u.replies), Err: fmt.Errorf("saga: parked reply %q of saga %q has unreadable saga metadata: %w", uuid, id, err)}
		}
		u.replies = append(u.replies, reply{index: len(u.replies), msg: msg, ref: ref, key: key})
		ids = append(ids, id)
	}
	if err := rows.Err(); err != nil {
		return nil, lk, fmt.Errorf("saga: claim parked replies: %w", st.explain(err))
	}
	if bad != nil || len(u.replies) == 0 {
		return nil, lk, bad
	}
	slices.Sort(ids)
	b := &pgx.Batch{}
	st.queueLockMany(b, slices.Compact(ids), &lk) // locked already: this reads them
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, lk, fmt.Errorf("saga: read the sagas of %d parked replies: %w", len(u.replies), st.explain(err))
	}
	lk.parked = map[string]bool{} // the re-drive applies them: none is behind the others
	return u.replies, lk, nil
}

// RedriveParked applies the parked replies of the definitions registered with o — replies
// that reached an orchestrator lacking their saga's version (see docs/sagas.md, "Rolling
// deploys: versions side by side") — and returns how many it applied. Run calls it every
// TimerInterval; tests and single-process harnesses may call it directly.
//
// Each transaction claims up to TimerBatch parked replies with their sagas (FOR UPDATE SKIP
// LOCKED), applies them in arrival order through the same transition as a reply handed over
// by a consumer, and deletes them. A parked reply whose transition fails is tried again in
// the next round (its attempts and error are kept with it, and `onceflow saga show` shows
// them); after MaxAttempts its saga is set stuck with the error and the reply recorded in
// inbox_poison, as a reply handed over by a consumer would be. Its saga's other parked
// replies wait until then; other sagas go on.
func (o *Orchestrator) RedriveParked(ctx context.Context) (int, error) {
	v := o.registered()
	if len(v.names) == 0 {
		return 0, nil
	}
	limit := o.timerBatch()
	skip := []string{} // not nil: pgx sends a nil slice as NULL, and `<> ALL (NULL)` matches nothing
	applied := 0
	for {
		u := &replyBatch{o: o, b: &pgx.Batch{}, redrive: &redrive{v: v, skip: skip, limit: limit}}
		res, err := o.run.Run(ctx, limit, u)
		o.settle(u, res, err)
		var me *inbox.MessageError
		switch {
		case errors.As(err, &me) && me.Index >= 0 && me.Index < len(u.replies):
			r := u.replies[me.Index]
			if ferr := o.parkedFailed(ctx, r, me.Err); ferr != nil {
				return applied, ferr
			}
			skip = append(skip, r.ref.ID)
			continue
		case errors.As(err, &me) && limit > 1:
			// The COMMIT refused the batch without naming a reply (a constraint an OnReplyTx
			// handler deferred): one reply per transaction finds it.
			limit = 1
			continue
		case err != nil:
			return applied, fmt.Errorf("saga: apply parked replies: %w", err)
		}
		applied += len(res.Applied)
		if len(u.replies) < limit {
			return applied, nil
		}
	}
}

// parkedFailed records that parked reply r failed with cause, in its own transaction: its
// attempts and error are kept with it; after MaxAttempts its saga is set stuck with the
// error, and the reply leaves saga_parked for inbox_poison (`saga retry` is its recovery, as
// for SettlePoison).
func (o *Orchestrator) parkedFailed(ctx context.Context, r reply, cause error) error {
	var attempts int
	var name string
	var gaveUp bool
	g := inbox.GiveUp{Source: "saga_parked", Err: cause,
		NoReplay: "a parked saga reply: its saga was set stuck when it was given up; resume the saga with `onceflow saga retry " + r.ref.ID +
			"` (a replay would apply an old reply to a saga that may have moved on)"}
	err := o.run.InTx(ctx, func(ctx context.Context, tx pgx.Tx) error {
		err := tx.QueryRow(ctx, o.st.park.fail, r.ref.ID, r.key, cause.Error()).Scan(&attempts)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil // applied by another orchestrator meanwhile
		}
		if err != nil || attempts < o.cfg.MaxAttempts {
			return err
		}
		gaveUp, g.Attempts = true, attempts
		if _, err := tx.Exec(ctx, o.st.park.remove, r.ref.ID, r.key); err != nil {
			return err
		}
		// No dedup key: the reply's was claimed when it parked.
		if _, err := o.run.GiveUpTx(ctx, tx, r.msg, "", g); err != nil {
			return err
		}
		reason := fmt.Sprintf("the parked %s reply of step %q (attempt %d) could not be applied after %d tries: %v", r.ref.Phase, r.ref.Step, r.ref.Attempt, attempts, cause)
		err = tx.QueryRow(ctx, o.st.stuck, r.ref.ID, reason).Scan(&name)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil // finished or stuck already: nothing to stop
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("saga: record the failure of a parked reply of saga %q: %w", r.ref.ID, o.st.explain(err))
	}
	switch {
	case gaveUp && name != "":
		o.run.LogGiveUp(r.msg, g)
		o.cfg.Metrics.Stuck(name)
		o.cfg.Logger.Error("saga: stuck: a parked reply could not be applied; resume it with `onceflow saga retry` once the cause is fixed",
			"saga_id", r.ref.ID, "saga", name, "step", r.ref.Step, "attempts", attempts, "err", cause)
	case gaveUp:
		o.run.LogGiveUp(r.msg, g)
	case attempts > 0:
		o.cfg.Logger.Warn("saga: a parked reply could not be applied; tried again in the next round",
			"saga_id", r.ref.ID, "step", r.ref.Step, "attempts", attempts, "max_attempts", o.cfg.MaxAttempts, "err", cause)
	}
	return nil
}
