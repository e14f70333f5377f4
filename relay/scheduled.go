package relay

import (
	"context"
	"math"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/outbox"
)

// Scheduled messages (outbox.DeliverAt, outbox.DeliverAfter) wait in outbox_scheduled
// (migration 0021) until they are due; every running relay moves due rows into the outbox
// on a goroutine of its own (scheduler), and the relay that holds a row's shard publishes it
// like any other.
//
// Why any live relay, not the one holding the shard. The move is one transaction that
// deletes the due rows from outbox_scheduled and inserts them into the outbox with their event
// ids: it publishes nothing, so it needs no lease and no fencing — moved by whichever relay,
// a row is moved once, and then belongs to its shard's owner. A move per shard would filter the
// due rows by key_hash % Shards, which the due_at index cannot serve, and would put a second
// query in the claim path; instead the claim path is untouched, and a row waits at most one
// check of one relay (they all check, so a relay that died costs nothing).
//
// Order. Moves are serialised by a transaction-scoped advisory lock per schema (a relay that
// finds it taken skips its turn: another relay is moving), and each moves the due rows in
// (due_at, seq) order, so a key's scheduled messages get their outbox ids — their place in
// the key's order — in due order, and after every message of the key already in the outbox.
// Rows locked by a CancelTx that has not committed yet are skipped (SKIP LOCKED: a user's
// open transaction never stalls the relay); if that transaction rolls back, the row is moved
// at the next check, after any later-due row of its key that was moved meanwhile.
//
// Timing. The scheduler sleeps until the next due time it knows, but at most
// Config.ScheduledCheckInterval while the relay is awake, so a row written due sooner is found
// within that interval; each check is one index probe of outbox_scheduled_due_idx. A sleeping
// relay (no traffic: it waits for NOTIFY, and costs about one round trip a second) checks only
// every outbox.ScheduledWakeWithin minus that interval: a row due sooner than
// ScheduledWakeWithin wakes it as an immediate row does (a NOTIFY only while a relay sleeps,
// never on a busy system), and a row due later is found before its time without one. Writes
// of rows due later than that never notify. A move that took rows
// wakes this relay's publishing loop at once, and the others through outbox_wake (a NOTIFY
// only when some relay sleeps), so a row is published about one claim after its move.

// scheduledMoveSQL moves at most $1 due rows and returns how many it moved, whether it held the
// lock, and the seconds until the next due row (NULL: none; negative: some are due but were
// skipped or over the limit).
func scheduledMoveSQL(schema string) string {
	sched := pgsql.Table(schema, "outbox_scheduled")
	return `WITH lock AS (SELECT pg_try_advisory_xact_lock(hashtext('onceflow.scheduled'), hashtext($2)) AS got),
	due AS (
		SELECT event_id FROM ` + sched + `
		WHERE due_at <= now() AND (SELECT got FROM lock)
		ORDER BY due_at, seq LIMIT $1 FOR UPDATE SKIP LOCKED),
	moved AS (DELETE FROM ` + sched + ` s USING due WHERE s.event_id = due.event_id
		RETURNING s.event_id, s.topic, s.partition_key, s.key_hash, s.payload, s.metadata, s.due_at, s.seq),
	ins AS (
		INSERT INTO ` + pgsql.Table(schema, "outbox") + ` (event_id, topic, partition_key, key_hash, payload, metadata)
		SELECT event_id, topic, partition_key, key_hash, payload, metadata FROM moved ORDER BY due_at, seq
		RETURNING 1),
	n AS (SELECT count(*) AS n FROM ins)
	SELECT (SELECT n FROM n), (SELECT got FROM lock),
		extract(epoch FROM (SELECT min(due_at) FROM ` + sched + ` WHERE due_at > now()) - clock_timestamp())::float8,
		CASE WHEN (SELECT n FROM n) > 0 THEN ` + pgsql.Ident(schema) + `.outbox_wake($3) ELSE false END`
}

// scheduler moves due scheduled rows into the outbox until ctx ends.
func (r *Relay) scheduler(ctx context.Context) {
	t := time.NewTimer(0)
	defer t.Stop()
	sql := scheduledMoveSQL(r.cfg.Schema)
	channel := outbox.NotifyChannel(r.cfg.Schema)
	fails := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-r.schedWake:
			if !t.Stop() {
				select {
				case <-t.C:
				default:
				}
			}
		}
		wait := r.cfg.ScheduledCheckInterval
		if since := r.asleepSince.Load(); since != 0 && time.Since(time.Unix(0, since)) >= wait {
			// Asleep for longer than a check: every row written since the last awake check
			// and due within outbox.ScheduledWakeWithin sent a notification (schedWake), so
			// a check per that window finds the others before their time.
			wait = max(wait, outbox.ScheduledWakeWithin-wait)
		}
		moved, next, err := r.moveDue(ctx, sql, channel)
		switch {
		case err != nil:
			if ctx.Err() != nil {
				return
			}
			fails++
			r.m.Failed(FailureDatabase, 1)
			r.log.Warn("relay could not move due scheduled messages; retrying", "err", err)
			wait = min(wait, backoffDelay(r.cfg.RetryBackoff, r.cfg.MaxRetryBackoff, fails, 0.5))
		case moved >= r.cfg.BatchSize:
			fails = 0
			wait = 0 // more may be due
		default:
			fails = 0
			if next != nil {
				wait = max(0, min(wait, *next))
			}
		}
		if moved > 0 {
			r.signal()
			r.log.Debug("relay moved due scheduled messages into the outbox", "rows", moved)
		}
		t.Reset(wait)
	}
}

// moveDue runs one move; next is how long until the next scheduled row is due (nil: none).
func (r *Relay) moveDue(ctx context.Context, sql, channel string) (moved int, next *time.Duration, err error) {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.StatementTimeout)
	defer cancel()
	var n int64
	var got bool
	var secs pgtype.Float8
	var woke *bool
	if err := r.pool.QueryRow(ctx, sql, r.cfg.BatchSize, r.cfg.Schema, channel).Scan(&n, &got, &secs, &woke); err != nil {
		return 0, nil, err
	}
	if secs.Valid {
		// Wake a millisecond late rather than early: the row is due at due_at <= now().
		d := time.Duration(math.Ceil(secs.Float64*1e3)) * time.Millisecond
		next = &d
	}
	return int(n), next, nil
}
