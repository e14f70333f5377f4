// Package status is onceflow's health read model: one look at a schema (relays and shard
// leases, the outbox backlog, retention backlogs, sagas, timers, inbox poison, the inbox's
// retry lane) through the
// packages' admins, and the problems it shows against thresholds, each with what to do.
// `onceflow status` prints it and exits 4 on a problem; the console's overview shows it; a
// service can serve it from a health endpoint.
package status

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/saga"
)

// Thresholds decide when a Report shows something stuck; `onceflow status` takes them as its
// --max-* flags. DefaultThresholds returns the CLI's defaults.
type Thresholds struct {
	MaxOldest     time.Duration // oldest pending row older than this
	MaxParked     int64         // more parked rows than this
	MaxHeartbeat  time.Duration // a relay's last heartbeat older than this while its row is live
	MaxRetention  int64         // more rows past the retention window than this, in any table
	MaxStuckSagas int64         // more sagas in state stuck than this
	MaxSagaAge    time.Duration // a saga running or compensating for longer than this (0: off)
	MaxPoison     int64         // more rows in inbox_poison than this
	Window        time.Duration // the retention window of processed_event and finished sagas
	// MaxTimerLag: a saga timer or operator request due longer ago than this means no
	// orchestrator fires them (none runs for the schema, or it cannot keep up).
	MaxTimerLag time.Duration
	// MaxReplayWait: an inbox replay request waiting longer than this means no process of its
	// consumer applies replays (none runs, or it has no replay loop). 0: no check.
	MaxReplayWait time.Duration
	// MaxVersionWait: a saga reply parked for longer than this, awaiting an orchestrator with
	// its saga's definition version, means no running orchestrator has that version
	// registered (a rolling deploy that removed it too early, or never finished). 0: no check.
	MaxVersionWait time.Duration
	// MaxScheduledOverdue: a scheduled message (outbox.DeliverAt) still waiting in
	// outbox_scheduled longer than this after its due time means no relay moves scheduled
	// messages: none runs for the schema, or every one that runs predates scheduled messages.
	// A running relay moves a message within about a second of its time. 0: no check.
	MaxScheduledOverdue time.Duration
	// MaxLaneWait: a key whose messages have waited in an inbox consumer's retry lane
	// (inbox.RetryAfter) longer than this — its head parked that long ago, none of its later
	// messages applied since — means its handler keeps asking for later: the provider it
	// waits for is down, or a message cannot succeed and the lane's attempts are high. 0: no
	// check.
	MaxLaneWait time.Duration
	// MaxLaneLag: a head of a retry lane due longer ago than this and still not applied means
	// no process of its consumer drains the lane (none runs, or a router without
	// Inbox.RouterPlugin), or the processes cannot keep up. A running one applies due heads
	// within its lane interval (1 s by default) plus the handler's time. 0: no check.
	MaxLaneLag time.Duration
}

// DefaultThresholds are `onceflow status`'s defaults.
func DefaultThresholds() Thresholds {
	return Thresholds{MaxOldest: 5 * time.Minute, MaxHeartbeat: time.Minute, MaxRetention: 100_000,
		MaxSagaAge: time.Hour, Window: 72 * time.Hour, MaxTimerLag: time.Minute, MaxReplayWait: time.Minute, MaxVersionWait: 5 * time.Minute,
		MaxScheduledOverdue: time.Minute, MaxLaneWait: time.Hour, MaxLaneLag: 5 * time.Minute}
}

// Report is one look at a schema; `onceflow status --json` prints it as is.
type Report struct {
	Schema    string    `json:"schema"`
	CheckedAt time.Time `json:"checked_at"`
	OK        bool      `json:"ok"`
	// Problems says what is stuck, one sentence each, with what to do next.
	Problems []string `json:"problems"`

	Outbox struct {
		Pending          int64   `json:"pending"`
		PendingExact     bool    `json:"pending_exact"`
		OldestID         int64   `json:"oldest_id,omitempty"`
		OldestAgeSeconds float64 `json:"oldest_age_seconds"`
		Parked           int64   `json:"parked"`
	} `json:"outbox"`
	// Scheduled is what waits in outbox_scheduled for its due time (outbox.DeliverAt), read
	// with relay.Admin.ScheduledSummary. It is not part of Outbox until due: a million
	// messages scheduled for tomorrow change neither the pending count nor the oldest age.
	Scheduled     Scheduled        `json:"scheduled"`
	Shards        int              `json:"shards"`
	ShardsUnowned int              `json:"shards_without_live_owner"`
	Relays        []Relay          `json:"relays"`
	Retention     []RetentionTable `json:"retention"`
	Sagas         []SagaCount      `json:"sagas"`
	// InboxPoison counts the messages batched consumers gave up on (inbox_poison), per
	// consumer; `onceflow inbox poison` lists them.
	InboxPoison []Poison `json:"inbox_poison"`
	// RetryLane is what waits in each inbox consumer's retry lane (inbox.RetryAfter): messages
	// parked by their handler, and the later messages of their keys parked behind them; read
	// with inbox.Admin.ParkedSummary. `onceflow inbox parked` lists them.
	RetryLane      []RetryLane `json:"retry_lane"`
	SagaStatesNote string      `json:"sagas_note,omitempty"`
	// SagasOverAge counts sagas running or compensating for longer than --max-saga-age
	// (capped, like the retention counts); OldestSaga is the oldest of them.
	SagasOverAge int64     `json:"sagas_over_age"`
	OldestSaga   *LongSaga `json:"oldest_saga,omitempty"`
	// OverdueTimers counts saga timers (step timeouts, re-sends, deadlines) and operator
	// requests (retry, compensate) due longer ago than MaxTimerLag, capped at
	// MaxOverdueTimers; OldestOverdue is the most overdue of them.
	OverdueTimers int64         `json:"overdue_saga_timers"`
	OldestOverdue *OverdueTimer `json:"oldest_overdue_timer,omitempty"`
	// AwaitingVersion counts, per definition name and version, the saga replies parked
	// because they reached orchestrators without that version registered; an orchestrator
	// that has it applies them (docs/sagas.md, "Rolling deploys: versions side by side").
	AwaitingVersion []AwaitingVersion `json:"awaiting_version"`
	thresholds      Thresholds
}

// AwaitingVersion counts the parked replies of one definition version.
type AwaitingVersion struct {
	Name    string `json:"name"`
	Version int    `json:"version"`
	// Replies and Sagas count the parked replies and the sagas they belong to;
	// OldestAgeSeconds is how long the oldest of them has waited.
	Replies          int64   `json:"replies"`
	Sagas            int64   `json:"sagas"`
	OldestAgeSeconds float64 `json:"oldest_age_seconds"`
}

// Scheduled is the state of the scheduled messages (outbox.DeliverAt, outbox.DeliverAfter).
type Scheduled struct {
	// Rows scheduled: exact when RowsExact (up to relay.ExactBacklogRows), else an estimate.
	Rows      int64 `json:"rows"`
	RowsExact bool  `json:"rows_exact"`
	// NextDue is the due time of the next message a relay moves into the outbox (nil: none
	// scheduled); in the past only while due messages wait to be moved.
	NextDue *time.Time `json:"next_due,omitempty"`
	// Overdue counts the messages due more than relay.ScheduledOverdueAfter (5 s) ago and
	// still not moved, up to relay.ExactBacklogRows (OverdueExact false above it).
	Overdue      int64 `json:"overdue"`
	OverdueExact bool  `json:"overdue_exact"`
	// OldestOverdueSeconds is how long the most overdue message is past its due time (0 when
	// none is due); OldestOverdueEventID is its event id (`onceflow outbox find` takes it).
	OldestOverdueSeconds float64 `json:"oldest_overdue_seconds"`
	OldestOverdueEventID string  `json:"oldest_overdue_event_id,omitempty"`
}

// OverdueTimer is a saga timer or operator request that no orchestrator fired.
type OverdueTimer struct {
	SagaID         string  `json:"saga_id"`
	Name           string  `json:"name"`
	Kind           string  `json:"kind"`   // step, deadline or operator
	Action         string  `json:"action"` // timeout, resend, run, deadline, retry or compensate
	OverdueSeconds float64 `json:"overdue_seconds"`
}

// MaxOverdueTimers caps the count of overdue saga timers, so the check costs the same with a
// million of them (it walks saga_timer_due_at_idx).
const MaxOverdueTimers = 1000

// Relay is one relay process, from its heartbeat row.
type Relay struct {
	ID                  string    `json:"id"`
	Host                string    `json:"host"`
	PID                 int       `json:"pid"`
	Shards              int       `json:"shards"`
	Live                bool      `json:"live"`
	HeartbeatAt         time.Time `json:"heartbeat_at"`
	HeartbeatAgeSeconds float64   `json:"heartbeat_age_seconds"`
}

// RetentionTable is one table's retention backlog.
type RetentionTable struct {
	Table string `json:"table"`
	// Rule says which rows are past retention.
	Rule string `json:"rule"`
	// Expired rows the cleaner may delete but has not yet; counted up to a cap (Exact false
	// above it).
	Expired int64 `json:"expired"`
	Exact   bool  `json:"exact"`
}

// Poison counts one inbox consumer's poison messages.
type Poison struct {
	Consumer string `json:"consumer"`
	// Count is the messages given up (state poison); replayed rows are not counted.
	Count int64 `json:"count"`
	// ReplayRequested counts replay requests waiting for a process of the consumer;
	// OldestRequestSeconds is how long the oldest of them has waited.
	ReplayRequested      int64   `json:"replay_requested,omitempty"`
	OldestRequestSeconds float64 `json:"oldest_request_seconds,omitempty"`
}

// RetryLane is what waits in one inbox consumer's retry lane.
type RetryLane struct {
	Consumer string `json:"consumer"`
	// Rows counts the parked messages, Keys the keys (lanes) they hold up; each is exact up to
	// inbox.ParkedCountCap (10000), else that many "or more" (the *_exact fields false).
	Rows      int64 `json:"rows"`
	RowsExact bool  `json:"rows_exact"`
	Keys      int64 `json:"keys"`
	KeysExact bool  `json:"keys_exact"`
	// OldestAgeSeconds is how long the longest-waiting key's head has been parked;
	// OldestTopic and OldestKey name that key ("" when the message has no key), OldestID its
	// row (`onceflow inbox parked` shows it).
	OldestAgeSeconds float64 `json:"oldest_age_seconds"`
	OldestTopic      string  `json:"oldest_topic"`
	OldestKey        string  `json:"oldest_key"`
	OldestID         int64   `json:"oldest_id"`
	// NextDue is when the consumer next applies a head; LagSeconds how long the earliest due
	// head is past its due time (0 when none is due).
	NextDue    *time.Time `json:"next_due,omitempty"`
	LagSeconds float64    `json:"lag_seconds"`
}

// SagaCount counts the unfinished sagas of one definition in one state.
type SagaCount struct {
	Name  string `json:"name"`
	State string `json:"state"`
	Count int64  `json:"count"`
	// OldestAgeSeconds is the time since the oldest of them started.
	OldestAgeSeconds float64 `json:"oldest_age_seconds"`
}

// LongSaga is one saga that has been running for too long.
type LongSaga struct {
	ID         string  `json:"id"`
	Name       string  `json:"name"`
	State      string  `json:"state"`
	AgeSeconds float64 `json:"age_seconds"`
}

// MaxSagasOverAge caps the count of sagas over --max-saga-age, so the check costs the same
// with a million of them.
const MaxSagasOverAge = 1000

// DB is what Read reads with: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
type DB interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Read takes one look at schema through the packages' admins (relay, inbox, idempotency,
// saga), each read bounded whatever the backlog: the outbox through relay.Admin.Backlog,
// the scheduled messages through relay.Admin.ScheduledSummary (counts capped on the due index),
// the inbox's retry lane through inbox.Admin.ParkedSummary (index ranges, counts capped),
// retention backlogs as counts capped just above th.MaxRetention on the age indexes, sagas by
// state over the unfinished states only (retention keeps finished ones by the million), long
// runners and overdue timers capped at MaxSagasOverAge and MaxOverdueTimers.
func Read(ctx context.Context, db DB, schema string, th Thresholds) (*Report, error) {
	relays, err := relay.NewAdmin(schema)
	if err != nil {
		return nil, err
	}
	inboxes, err := inbox.NewAdmin(schema)
	if err != nil {
		return nil, err
	}
	records, err := idempotency.NewAdmin(schema)
	if err != nil {
		return nil, err
	}
	sagas, err := saga.NewAdmin(schema)
	if err != nil {
		return nil, err
	}
	b, err := relays.Backlog(ctx, db)
	if err != nil {
		return nil, err
	}
	r := &Report{Schema: schema, CheckedAt: b.CheckedAt, thresholds: th, Problems: []string{}}
	r.Outbox.Pending, r.Outbox.PendingExact, r.Outbox.OldestID = b.Rows, b.Exact, b.OldestID
	r.Outbox.OldestAgeSeconds, r.Outbox.Parked = b.OldestAge().Seconds(), b.Parked
	age := func(t time.Time) float64 { return r.CheckedAt.Sub(t).Seconds() }

	sched, err := relays.ScheduledSummary(ctx, db)
	if err != nil {
		return nil, err
	}
	r.Scheduled = Scheduled{Rows: sched.Rows, RowsExact: sched.Exact, Overdue: sched.Overdue, OverdueExact: !sched.OverdueCapped}
	if !sched.NextDue.IsZero() {
		r.Scheduled.NextDue = &sched.NextDue
	}
	if lag := sched.Lag(); lag > 0 {
		r.Scheduled.OldestOverdueSeconds, r.Scheduled.OldestOverdueEventID = lag.Seconds(), sched.NextEventID
	}

	shards, err := relays.Shards(ctx, db)
	if err != nil {
		return nil, err
	}
	r.Shards, r.ShardsUnowned = shards.Total, shards.Unowned
	members, err := relays.Relays(ctx, db)
	if err != nil {
		return nil, err
	}
	r.Relays = make([]Relay, len(members))
	for i, m := range members {
		r.Relays[i] = Relay{ID: m.ID, Host: m.Host, PID: m.PID, Shards: m.Shards, Live: m.Live, HeartbeatAt: m.HeartbeatAt,
			HeartbeatAgeSeconds: m.HeartbeatAge.Seconds()}
	}

	capped := th.MaxRetention + 1
	for _, t := range []struct {
		table, rule string
		count       func() (int64, error)
	}{
		{"processed_event", "processed_at older than the window (not a live saga's barrier row)",
			func() (int64, error) { return inboxes.Expired(ctx, db, th.Window, capped, false) }},
		{"idempotency_record", "expires_at passed", func() (int64, error) { return records.Expired(ctx, db, capped) }},
		{"saga", "finished longer than the Window ago", func() (int64, error) { return sagas.Expired(ctx, db, th.Window, capped) }},
	} {
		n, err := t.count()
		if err != nil {
			return nil, err
		}
		r.Retention = append(r.Retention, RetentionTable{Table: t.table, Rule: t.rule, Expired: n, Exact: n < capped})
	}

	counts, err := sagas.Unfinished(ctx, db)
	if err != nil {
		return nil, err
	}
	r.Sagas = make([]SagaCount, len(counts))
	for i, c := range counts {
		r.Sagas[i] = SagaCount{Name: c.Name, State: string(c.State), Count: c.Count, OldestAgeSeconds: age(c.Oldest)}
	}
	// Replayed rows are history, not problems; a replay request that waits long has no
	// process of its consumer to apply it.
	poison, err := inboxes.PoisonSummary(ctx, db)
	if err != nil {
		return nil, err
	}
	r.InboxPoison = make([]Poison, len(poison))
	for i, p := range poison {
		r.InboxPoison[i] = Poison{Consumer: p.Consumer, Count: p.Poison, ReplayRequested: p.ReplayRequested}
		if p.ReplayRequested > 0 {
			r.InboxPoison[i].OldestRequestSeconds = p.OldestRequestAge().Seconds()
		}
	}
	lanes, err := inboxes.ParkedSummary(ctx, db)
	if err != nil {
		return nil, err
	}
	r.RetryLane = make([]RetryLane, len(lanes))
	for i, l := range lanes {
		r.RetryLane[i] = RetryLane{Consumer: l.Consumer, Rows: l.Rows, RowsExact: l.RowsExact, Keys: l.Keys, KeysExact: l.KeysExact,
			OldestAgeSeconds: l.OldestAge().Seconds(), OldestTopic: l.OldestTopic, OldestKey: l.OldestLane, OldestID: l.OldestID, LagSeconds: l.Lag().Seconds()}
		if !l.NextDue.IsZero() {
			r.RetryLane[i].NextDue = &l.NextDue
		}
	}
	parked, err := sagas.ParkedByVersion(ctx, db)
	if err != nil {
		return nil, err
	}
	r.AwaitingVersion = make([]AwaitingVersion, len(parked))
	for i, p := range parked {
		r.AwaitingVersion[i] = AwaitingVersion{Name: p.Name, Version: p.Version, Replies: p.Replies, Sagas: p.Sagas,
			OldestAgeSeconds: p.CheckedAt.Sub(p.Oldest).Seconds()}
	}
	r.SagaStatesNote = "finished sagas (completed, compensated) are not counted: `onceflow saga list` lists them"
	if th.MaxSagaAge > 0 {
		// Stuck sagas are not counted here: --max-stuck-sagas reports them.
		long, err := sagas.LongRunning(ctx, db, th.MaxSagaAge, MaxSagasOverAge)
		if err != nil {
			return nil, err
		}
		r.SagasOverAge = long.Count
		if o := long.Oldest; o != nil {
			r.OldestSaga = &LongSaga{ID: o.ID, Name: o.Name, State: string(o.State), AgeSeconds: long.CheckedAt.Sub(o.CreatedAt).Seconds()}
		}
	}
	if th.MaxTimerLag > 0 {
		due, err := sagas.OverdueTimers(ctx, db, th.MaxTimerLag, MaxOverdueTimers)
		if err != nil {
			return nil, err
		}
		r.OverdueTimers = due.Count
		if o := due.Oldest; o != nil {
			r.OldestOverdue = &OverdueTimer{SagaID: o.SagaID, Name: o.Name, Kind: o.Kind, Action: o.Action,
				OverdueSeconds: due.CheckedAt.Sub(o.Due).Seconds()}
		}
	}
	r.check()
	return r, nil
}

// check fills Problems and OK from the thresholds.
func (r *Report) check() {
	th := r.thresholds
	add := func(format string, args ...any) { r.Problems = append(r.Problems, fmt.Sprintf(format, args...)) }
	oldest := time.Duration(r.Outbox.OldestAgeSeconds * float64(time.Second))
	live := 0
	for _, rl := range r.Relays {
		if rl.Live {
			live++
			if age := time.Duration(rl.HeartbeatAgeSeconds * float64(time.Second)); age > th.MaxHeartbeat {
				add("relay %q on %s last beat %s ago (over %s): it is hung or cannot reach the database; check its logs", rl.ID, rl.Host, age.Round(time.Second), th.MaxHeartbeat)
			}
		}
	}
	if r.Outbox.Pending > 0 && live == 0 {
		add("%s pending and no live relay: start one (`onceflow relay --schema %s`)", count(r.Outbox.Pending, "row", "rows"), r.Schema)
	}
	if oldest > th.MaxOldest {
		add("the oldest pending row (id %d) waits for %s (over %s): `onceflow outbox inspect --failing` shows refused rows, the relay logs say why", r.Outbox.OldestID, oldest.Round(time.Second), th.MaxOldest)
	}
	if lag := time.Duration(r.Scheduled.OldestOverdueSeconds * float64(time.Second)); th.MaxScheduledOverdue > 0 && lag > th.MaxScheduledOverdue {
		n := count(max(r.Scheduled.Overdue, 1), "scheduled message is", "scheduled messages are")
		if !r.Scheduled.OverdueExact {
			n = fmt.Sprintf("%d or more scheduled messages are", r.Scheduled.Overdue)
		}
		add("%s overdue; the most overdue, event %s, was due %s ago (over %s): no relay moves scheduled messages into the outbox. "+
			"Start one (`onceflow relay --schema %s`), or upgrade the running ones (relays older than scheduled messages leave them waiting), or check their logs",
			n, r.Scheduled.OldestOverdueEventID, lag.Round(time.Second), th.MaxScheduledOverdue, r.Schema)
	}
	if r.Outbox.Parked > th.MaxParked {
		add("%s parked (over %d): `onceflow outbox parked` shows why, `onceflow outbox replay` sends them again", count(r.Outbox.Parked, "row", "rows"), th.MaxParked)
	}
	for _, t := range r.Retention {
		if t.Expired > th.MaxRetention {
			add("%s holds more than %d rows past retention: is `onceflow cleanup` scheduled?", t.Table, th.MaxRetention)
		}
	}
	var stuck int64
	for _, s := range r.Sagas {
		if s.State == "stuck" {
			stuck += s.Count
		}
	}
	if stuck > th.MaxStuckSagas {
		add("%d sagas stuck (over %d): `onceflow saga list --state stuck`, then `onceflow saga retry`", stuck, th.MaxStuckSagas)
	}
	if r.SagasOverAge > 0 && r.OldestSaga != nil {
		more := ""
		if r.SagasOverAge >= MaxSagasOverAge {
			more = " or more"
		}
		o := r.OldestSaga
		add("%d%s sagas running or compensating for longer than %s; the oldest, %s (%s), is %s for %s: `onceflow saga show %s` says what it waits for",
			r.SagasOverAge, more, th.MaxSagaAge, o.ID, o.Name, o.State, time.Duration(o.AgeSeconds*float64(time.Second)).Round(time.Second), o.ID)
	}
	if r.OverdueTimers > 0 && r.OldestOverdue != nil {
		more := ""
		if r.OverdueTimers >= MaxOverdueTimers {
			more = " or more"
		}
		o := r.OldestOverdue
		add("%d%s saga timers and operator requests are overdue (over %s); the oldest, %s %s of saga %s (%s), for %s: no orchestrator fires them. "+
			"Start the service that runs the saga orchestrator (saga.Orchestrator.Run) on schema %s, or check its logs",
			r.OverdueTimers, more, th.MaxTimerLag, o.Kind, o.Action, o.SagaID, o.Name,
			time.Duration(o.OverdueSeconds*float64(time.Second)).Round(time.Second), r.Schema)
	}
	for _, a := range r.AwaitingVersion {
		if wait := time.Duration(a.OldestAgeSeconds * float64(time.Second)); th.MaxVersionWait > 0 && wait > th.MaxVersionWait {
			add("%d replies of %d %s sagas of version %d are parked, the oldest for %s (over %s): no running orchestrator has %s version %d registered. "+
				"Deploy (or keep running) an orchestrator that registers it (saga.Register) until `onceflow saga versions` shows none of its sagas unfinished; "+
				"it applies the parked replies in order", a.Replies, a.Sagas, a.Name, a.Version, wait.Round(time.Second), th.MaxVersionWait, a.Name, a.Version)
		}
	}
	var poison int64
	for _, p := range r.InboxPoison {
		poison += p.Count
	}
	if poison > th.MaxPoison {
		add("%s given up as poison (over %d): `onceflow inbox poison` shows them and why; once the cause is fixed, "+
			"`onceflow inbox poison replay --consumer <name>` applies them again", count(poison, "inbox message", "inbox messages"), th.MaxPoison)
	}
	for _, p := range r.InboxPoison {
		wait := time.Duration(p.OldestRequestSeconds * float64(time.Second))
		if th.MaxReplayWait > 0 && p.ReplayRequested > 0 && wait > th.MaxReplayWait {
			add("%d replay requests of inbox consumer %q wait, the oldest for %s (over %s): no process of that consumer applies replays. "+
				"Start it — a batched consumer (inboxkafka.BatchConsumer with ib.Batch, BatchNoPublish or BatchFunc) or a router with "+
				"ib.Poison and router.AddPlugin(ib.RouterPlugin) — or check its logs; `onceflow inbox poison --consumer %s` shows the rows",
				p.ReplayRequested, p.Consumer, wait.Round(time.Second), th.MaxReplayWait, p.Consumer)
		}
	}
	for _, l := range r.RetryLane {
		wait := time.Duration(l.OldestAgeSeconds * float64(time.Second)).Round(time.Second)
		if th.MaxLaneWait > 0 && wait > th.MaxLaneWait {
			what := fmt.Sprintf("key %q (topic %s) of inbox consumer %q has waited %s in the retry lane (over %s): its later messages wait behind it",
				l.OldestKey, l.OldestTopic, l.Consumer, wait, th.MaxLaneWait)
			if l.OldestKey == "" {
				what = fmt.Sprintf("a message without a key (topic %s, row %d) of inbox consumer %q has waited %s in the retry lane (over %s)",
					l.OldestTopic, l.OldestID, l.Consumer, wait, th.MaxLaneWait)
			}
			add("%s. The consumer has %s of %s parked: their handler keeps asking for later (inbox.RetryAfter), so the provider it waits for may be down. "+
				"`onceflow inbox parked --consumer %s` lists them; once the provider is back, `onceflow inbox parked release --consumer %s` retries them now",
				what, countOrMore(l.Rows, l.RowsExact, "message", "messages"), countOrMore(l.Keys, l.KeysExact, "key", "keys"), l.Consumer, l.Consumer)
		}
		if lag := time.Duration(l.LagSeconds * float64(time.Second)).Round(time.Second); th.MaxLaneLag > 0 && lag > th.MaxLaneLag {
			add("a message of inbox consumer %q's retry lane was due %s ago (over %s) and is still parked: no process of that consumer applies the lane, or they cannot keep up. "+
				"Start it — a batched consumer (inboxkafka.BatchConsumer) or a router with ib.Poison and router.AddPlugin(ib.RouterPlugin) — or check its logs; "+
				"`onceflow inbox parked --consumer %s` shows the rows", l.Consumer, lag, th.MaxLaneLag, l.Consumer)
		}
	}
	r.OK = len(r.Problems) == 0
}

// countOrMore is count's, or "more than 10000 rows" for a count that stopped one past its cap.
func countOrMore(n int64, exact bool, one, many string) string {
	if !exact {
		return fmt.Sprintf("more than %d %s", n-1, many)
	}
	return count(n, one, many)
}

// count is "1 row", "2 rows".
func count(n int64, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return fmt.Sprintf("%d %s", n, many)
}
