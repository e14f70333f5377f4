package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/sqltx"
)

// Scheduled messages.
//
// A message marked with DeliverAt or DeliverAfter is written, by the same WriteTx (or
// WriteSQLTx, QueueWriteTx, a TxPublisher) and in the same statement as the call's other
// messages, into the schema's outbox_scheduled table instead of the outbox: it commits or rolls
// back with the business rows like any message, and costs the relay's claims nothing until it is
// due. The mark is metadata, as ToTopic's is, rather than an option of WriteTx, so that every
// entry point that takes Watermill messages (a cqrs.EventBus through ContextPublisher, an inbox
// handler's returned messages) can schedule without a new signature; the write consumes the
// mark: it is never stored in the message's metadata nor published.
//
// When it is due (by the database's clock), a running relay moves it into the outbox in one
// transaction, keeping its event id, and publishes it like any other row, usually within a few
// hundred milliseconds (docs/relay.md, "Scheduled messages"). It enters its partition key's
// order at that moment: after every message of the key that was in the outbox before it was
// moved, before every one written after; scheduled messages of one key are moved in the order
// of their due times (ties in write order). Until it is moved, CancelTx withdraws it.

// MetadataDeliverAt and MetadataDeliverAfter mark a message as scheduled (DeliverAt,
// DeliverAfter). The writer consumes them: they are never stored with the row or published.
const (
	// MetadataDeliverAt holds the due time, RFC 3339 with up to microseconds.
	MetadataDeliverAt = "onceflow_deliver_at"
	// MetadataDeliverAfter holds a delay in Go's time.Duration syntax ("10m", "1h30m"),
	// counted from the writing transaction's start on the database's clock.
	MetadataDeliverAfter = "onceflow_deliver_after"
)

// ScheduledWakeWithin is how soon a scheduled message must be due for its write to wake a
// sleeping relay, as a write of an immediate message does (a NOTIFY on commit, only while some
// relay of the schema sleeps: see Config.DisableNotify). A sleeping relay looks for newly
// scheduled rows only about this often (an awake one every relay.Config.ScheduledCheckInterval),
// so a message due later than this is found before its time without any notification, and the
// write of one due tomorrow never notifies.
const ScheduledWakeWithin = 5 * time.Second

// ErrInvalidSchedule is wrapped in the *ValidationError of a message whose scheduling mark
// cannot be read (set the mark with DeliverAt or DeliverAfter, not by hand).
var ErrInvalidSchedule = errors.New("scheduling metadata is not valid (use outbox.DeliverAt or outbox.DeliverAfter)")

// DeliverAt schedules msg for time t: the write call that takes it keeps it aside, and a relay
// publishes it once the database's clock reaches t (a time in the past: at the relays' next
// check, well within a second). It returns msg for chaining:
//
//	err := outbox.WriteTx(ctx, tx, "orders.reminder",
//		outbox.DeliverAt(outbox.NewMessage(payload), order.PlacedAt.Add(24*time.Hour)))
//
// Like River's InsertOpts.ScheduledAt, the message is written now, in the caller's
// transaction, and cancellable until due with CancelTx (by its UUID). It replaces an earlier
// DeliverAfter.
func DeliverAt(msg *message.Message, t time.Time) *message.Message {
	delete(msg.Metadata, MetadataDeliverAfter)
	msg.Metadata.Set(MetadataDeliverAt, t.UTC().Format("2006-01-02T15:04:05.999999Z07:00"))
	return msg
}

// DeliverAfter schedules msg for d after its writing transaction began, on the database's
// clock (now() in PostgreSQL), so the application's clock does not matter. d <= 0 means at
// once (through the scheduled table, moved by the relay's next check). It returns msg for
// chaining; it replaces an earlier DeliverAt. See DeliverAt.
func DeliverAfter(msg *message.Message, d time.Duration) *message.Message {
	delete(msg.Metadata, MetadataDeliverAt)
	msg.Metadata.Set(MetadataDeliverAfter, d.String())
	return msg
}

// schedule is one message's parsed mark.
type schedule struct {
	set     bool
	soon    bool   // due within ScheduledWakeWithin: the write wakes a sleeping relay
	at      string // RFC 3339, or "" when the delay counts
	afterUS int64  // delay in microseconds
}

func scheduleOf(msg *message.Message) (schedule, error) {
	at, hasAt := msg.Metadata[MetadataDeliverAt]
	after, hasAfter := msg.Metadata[MetadataDeliverAfter]
	switch {
	case hasAt:
		t, err := time.Parse(time.RFC3339Nano, at)
		if err != nil {
			return schedule{}, fmt.Errorf("%w: %s %q: %v", ErrInvalidSchedule, MetadataDeliverAt, at, err)
		}
		return schedule{set: true, soon: time.Until(t) < ScheduledWakeWithin, at: t.UTC().Format("2006-01-02T15:04:05.999999Z07:00")}, nil
	case hasAfter:
		d, err := time.ParseDuration(after)
		if err != nil {
			return schedule{}, fmt.Errorf("%w: %s %q: %v", ErrInvalidSchedule, MetadataDeliverAfter, after, err)
		}
		return schedule{set: true, soon: d < ScheduledWakeWithin, afterUS: max(0, d.Microseconds())}, nil
	}
	return schedule{}, nil
}

// ScheduledAt reports the due time DeliverAt set on msg, and whether it has one.
func ScheduledAt(msg *message.Message) (time.Time, bool) {
	t, err := time.Parse(time.RFC3339Nano, msg.Metadata.Get(MetadataDeliverAt))
	return t, err == nil
}

// scheduledInsert is the statement of a call with scheduled messages: both inserts in one
// statement (one round trip), the immediate messages in call order as WriteTx writes them, the
// scheduled ones into outbox_scheduled; the wake-up check ($15) only when immediate rows are
// written or a scheduled one is due within ScheduledWakeWithin (a row due later never
// notifies: the relays find it before its time, and wake themselves when it is due).
func scheduledInsert(schema string) string {
	return `WITH s AS (
		INSERT INTO ` + pgsql.Table(schema, "outbox_scheduled") + ` (event_id, topic, partition_key, key_hash, payload, metadata, due_at)
		SELECT e, t, k, h, p, m::jsonb, COALESCE(NULLIF(a, '')::timestamptz, now() + d * interval '1 microsecond')
		FROM unnest($1::text[], $2::uuid[], $3::text[], $4::bigint[], $5::bytea[], $6::text[], $7::text[], $8::bigint[]) AS u(t, e, k, h, p, m, a, d)
		RETURNING 1),
	o AS (
		INSERT INTO ` + pgsql.Table(schema, "outbox") + ` (event_id, topic, partition_key, key_hash, payload, metadata)
		SELECT e, t, k, h, p, m::jsonb
		FROM unnest($9::text[], $10::uuid[], $11::text[], $12::bigint[], $13::bytea[], $14::text[]) AS u(t, e, k, h, p, m)
		RETURNING 1)
	SELECT (SELECT count(*) FROM s) + (SELECT count(*) FROM o),
		CASE WHEN $15::boolean THEN ` + pgsql.Ident(schema) + `.outbox_wake($16) ELSE false END`
}

// scheduledStmt splits a call's validated messages between the two inserts of scheduledInsert.
func (w *Writer) scheduledStmt(check bool, topics, ids, keys []string, hashes []int64, payloads [][]byte, metas []string, scheds []schedule) insertStmt {
	var st, se, sk, sm, sa []string
	var sh, sd []int64
	var sp [][]byte
	var ot, oe, ok, om []string
	var oh []int64
	var op [][]byte
	soon := false
	for i := range ids {
		if scheds[i].set {
			soon = soon || scheds[i].soon
			st, se, sk, sh, sp, sm = append(st, topics[i]), append(se, ids[i]), append(sk, keys[i]), append(sh, hashes[i]), append(sp, payloads[i]), append(sm, metas[i])
			sa, sd = append(sa, scheds[i].at), append(sd, scheds[i].afterUS)
			continue
		}
		ot, oe, ok, oh, op, om = append(ot, topics[i]), append(oe, ids[i]), append(ok, keys[i]), append(oh, hashes[i]), append(op, payloads[i]), append(om, metas[i])
	}
	check = check && (len(oe) > 0 || soon)
	// Empty, not nil, slices: a nil slice would be sent as NULL, which unnest reads as no rows
	// too, but database/sql drivers encode the literal either way.
	nz := func(s []string) []string {
		if s == nil {
			return []string{}
		}
		return s
	}
	nzi := func(s []int64) []int64 {
		if s == nil {
			return []int64{}
		}
		return s
	}
	nzb := func(s [][]byte) [][]byte {
		if s == nil {
			return [][]byte{}
		}
		return s
	}
	return insertStmt{
		sql: w.scheduled, n: len(ids), check: check, row: true,
		args: []any{nz(st), nz(se), nz(sk), nzi(sh), nzb(sp), nz(sm), nz(sa), nzi(sd),
			nz(ot), nz(oe), nz(ok), nzi(oh), nzb(op), nz(om), check, NotifyChannel(w.cfg.Schema)},
	}
}

// CancelTx withdraws, as part of tx, the scheduled message with this event id (the UUID of the
// message given to DeliverAt or DeliverAfter), with the default schema. See Writer.CancelTx.
func CancelTx(ctx context.Context, tx pgx.Tx, eventID string) (cancelled bool, err error) {
	return defaultWriter.CancelTx(ctx, tx, eventID)
}

// CancelSQLTx is CancelTx for a database/sql transaction, with the default schema.
func CancelSQLTx(ctx context.Context, tx *sql.Tx, eventID string) (cancelled bool, err error) {
	return defaultWriter.CancelSQLTx(ctx, tx, eventID)
}

// CancelTx withdraws the scheduled message with this event id as part of tx, and reports
// whether it did: true when the message was still waiting for its due time (it will never be
// published, if tx commits); false when there is no such scheduled message — it was already
// moved into the outbox to be published (too late: cancelling does not recall a message from
// the outbox or the broker), was cancelled before, or never existed. A relay moving the message
// at this very moment holds its row: CancelTx waits for that move to commit and then reports
// false.
func (w *Writer) CancelTx(ctx context.Context, tx pgx.Tx, eventID string) (cancelled bool, err error) {
	return w.cancel(ctx, sqltx.Pgx(tx), eventID)
}

// CancelSQLTx is CancelTx for a database/sql transaction.
func (w *Writer) CancelSQLTx(ctx context.Context, tx *sql.Tx, eventID string) (cancelled bool, err error) {
	return w.cancel(ctx, sqltx.Std(tx), eventID)
}

func (w *Writer) cancel(ctx context.Context, q sqltx.Querier, eventID string) (bool, error) {
	id, err := uuid.Parse(eventID)
	if err != nil {
		return false, fmt.Errorf("outbox: cancel %q: %w", eventID, ErrInvalidUUID)
	}
	n, err := q.Exec(ctx, `DELETE FROM `+pgsql.Table(w.cfg.Schema, "outbox_scheduled")+` WHERE event_id = $1::uuid`, id.String())
	if err != nil {
		if code := sqltx.SQLState(err); code == "42P01" {
			return false, fmt.Errorf("outbox: cancel scheduled message %s in %s: %w (the schema lacks migrations this version needs: run `onceflow migrate up --schema %s` or migrations.Up)", id, w.cfg.Schema, err, w.cfg.Schema)
		}
		return false, fmt.Errorf("outbox: cancel scheduled message %s in %s: %w", id, w.cfg.Schema, err)
	}
	return n == 1, nil
}
