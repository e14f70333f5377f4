package console

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgsql"
	cleaning "github.com/onceflow/onceflow/internal/retention"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/saga"
)

// Thresholds decide when a Status reports something stuck; `onceflow status` takes them as
// its --max-* flags. DefaultThresholds returns the CLI's defaults.
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
}

// DefaultThresholds are `onceflow status`'s defaults.
func DefaultThresholds() Thresholds {
	return Thresholds{MaxOldest: 5 * time.Minute, MaxHeartbeat: time.Minute, MaxRetention: 100_000,
		MaxSagaAge: time.Hour, Window: 72 * time.Hour, MaxTimerLag: time.Minute, MaxReplayWait: time.Minute, MaxVersionWait: 5 * time.Minute}
}

// Status is one look at a schema; --json prints it as is.
type Status struct {
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
	Shards        int           `json:"shards"`
	ShardsUnowned int           `json:"shards_without_live_owner"`
	Relays        []StatusRelay `json:"relays"`
	Retention     []StatusTable `json:"retention"`
	Sagas         []StatusSagas `json:"sagas"`
	// InboxPoison counts the messages batched consumers gave up on (inbox_poison), per
	// consumer; `onceflow inbox poison` lists them.
	InboxPoison    []StatusPoison `json:"inbox_poison"`
	SagaStatesNote string         `json:"sagas_note,omitempty"`
	// SagasOverAge counts sagas running or compensating for longer than --max-saga-age
	// (capped, like the retention counts); OldestSaga is the oldest of them.
	SagasOverAge int64       `json:"sagas_over_age"`
	OldestSaga   *StatusSaga `json:"oldest_saga,omitempty"`
	// OverdueTimers counts saga timers (step timeouts, re-sends, deadlines) and operator
	// requests (retry, compensate) due longer ago than MaxTimerLag, capped at
	// MaxOverdueTimers; OldestOverdue is the most overdue of them.
	OverdueTimers int64               `json:"overdue_saga_timers"`
	OldestOverdue *StatusOverdueTimer `json:"oldest_overdue_timer,omitempty"`
	// AwaitingVersion counts, per definition name and version, the saga replies parked
	// because they reached orchestrators without that version registered; an orchestrator
	// that has it applies them (docs/sagas.md, "Rolling deploys: versions side by side").
	AwaitingVersion []StatusAwaiting `json:"awaiting_version"`
	thresholds      Thresholds
}

// StatusAwaiting counts the parked replies of one definition version.
type StatusAwaiting struct {
	Name    string `json:"name"`
	Version int    `json:"version"`
	// Replies and Sagas count the parked replies and the sagas they belong to;
	// OldestAgeSeconds is how long the oldest of them has waited.
	Replies          int64   `json:"replies"`
	Sagas            int64   `json:"sagas"`
	OldestAgeSeconds float64 `json:"oldest_age_seconds"`
}

// StatusOverdueTimer is a saga timer or operator request that no orchestrator fired.
type StatusOverdueTimer struct {
	SagaID         string  `json:"saga_id"`
	Name           string  `json:"name"`
	Kind           string  `json:"kind"`   // step, deadline or operator
	Action         string  `json:"action"` // timeout, resend, run, deadline, retry or compensate
	OverdueSeconds float64 `json:"overdue_seconds"`
}

// MaxOverdueTimers caps the count of overdue saga timers, so the check costs the same with a
// million of them (it walks saga_timer_due_at_idx).
const MaxOverdueTimers = 1000

// StatusRelay is one relay process, from its heartbeat row.
type StatusRelay struct {
	ID                  string    `json:"id"`
	Host                string    `json:"host"`
	PID                 int       `json:"pid"`
	Shards              int       `json:"shards"`
	Live                bool      `json:"live"`
	HeartbeatAt         time.Time `json:"heartbeat_at"`
	HeartbeatAgeSeconds float64   `json:"heartbeat_age_seconds"`
}

// StatusTable is one table's retention backlog.
type StatusTable struct {
	Table string `json:"table"`
	// Rule says which rows are past retention.
	Rule string `json:"rule"`
	// Expired rows the cleaner may delete but has not yet; counted up to a cap (Exact false
	// above it).
	Expired int64 `json:"expired"`
	Exact   bool  `json:"exact"`
}

// StatusPoison counts one inbox consumer's poison messages.
type StatusPoison struct {
	Consumer string `json:"consumer"`
	// Count is the messages given up (state poison); replayed rows are not counted.
	Count int64 `json:"count"`
	// ReplayRequested counts replay requests waiting for a process of the consumer;
	// OldestRequestSeconds is how long the oldest of them has waited.
	ReplayRequested      int64   `json:"replay_requested,omitempty"`
	OldestRequestSeconds float64 `json:"oldest_request_seconds,omitempty"`
}

// StatusSagas counts the unfinished sagas of one definition in one state.
type StatusSagas struct {
	Name  string `json:"name"`
	State string `json:"state"`
	Count int64  `json:"count"`
	// OldestAgeSeconds is the time since the oldest of them started.
	OldestAgeSeconds float64 `json:"oldest_age_seconds"`
}

// StatusSaga is one saga that has been running for too long.
type StatusSaga struct {
	ID         string  `json:"id"`
	Name       string  `json:"name"`
	State      string  `json:"state"`
	AgeSeconds float64 `json:"age_seconds"`
}

// MaxSagasOverAge caps the count of sagas over --max-saga-age, so the check costs the same
// with a million of them.
const MaxSagasOverAge = 1000

// ReadStatus reads everything with queries whose cost does not grow with the backlog: the
// outbox through relay.Admin.Backlog, retention backlogs as counts capped just above the
// threshold (on the age indexes), sagas by state on saga_state_created_idx (an index-only
// scan) for the unfinished states only: retention keeps finished ones by the million, and
// "state NOT IN (finished)" read every one of them (1.5 s at 1M sagas).
func ReadStatus(ctx context.Context, pool DB, schema string, th Thresholds) (*Status, error) {
	admin, err := relay.NewAdmin(schema)
	if err != nil {
		return nil, err
	}
	b, err := admin.Backlog(ctx, pool)
	if err != nil {
		return nil, err
	}
	r := &Status{Schema: schema, CheckedAt: b.CheckedAt, thresholds: th, Problems: []string{}}
	r.Outbox.Pending, r.Outbox.PendingExact, r.Outbox.OldestID = b.Rows, b.Exact, b.OldestID
	r.Outbox.OldestAgeSeconds, r.Outbox.Parked = b.OldestAge().Seconds(), b.Parked
	t := func(name string) string { return pgsql.Table(schema, name) }

	if err := pool.QueryRow(ctx, `SELECT count(*)::int, count(*) FILTER (WHERE owner = '' OR expires_at <= now()
		OR NOT EXISTS (SELECT 1 FROM `+t("relay_member")+` m WHERE m.id = l.owner AND m.expires_at > now()))::int FROM `+t("relay_lease")+` l`).
		Scan(&r.Shards, &r.ShardsUnowned); err != nil {
		return nil, fmt.Errorf("read shard leases of schema %q: %w", schema, err)
	}
	rows, err := pool.Query(ctx, `SELECT m.id, m.host, m.pid,
			(SELECT count(*) FROM `+t("relay_lease")+` l WHERE l.owner = m.id AND l.expires_at > now())::int,
			m.expires_at > now(), m.heartbeat_at, extract(epoch FROM now() - m.heartbeat_at)::float8
		FROM `+t("relay_member")+` m ORDER BY m.id`)
	if err != nil {
		return nil, fmt.Errorf("read relays of schema %q: %w", schema, err)
	}
	r.Relays, err = pgx.CollectRows(rows, pgx.RowToStructByPos[StatusRelay])
	if err != nil {
		return nil, fmt.Errorf("read relays of schema %q: %w", schema, err)
	}

	capped := th.MaxRetention + 1
	for _, tbl := range []struct{ table, rule, where string }{
		{"processed_event", "processed_at older than the window (not a live saga's barrier row)",
			"processed_at < now() - make_interval(secs => $2) AND " + cleaning.NotLiveBarrier(schema)},
		{"idempotency_record", "expires_at passed", "expires_at < now()"},
		{"saga", "finished longer than the Window ago", "finished_at < now() - make_interval(secs => $2)"},
	} {
		st := StatusTable{Table: tbl.table, Rule: tbl.rule}
		args := []any{capped}
		if strings.Contains(tbl.where, "$2") {
			args = append(args, th.Window.Seconds())
		}
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT 1 FROM `+t(tbl.table)+` WHERE `+tbl.where+` LIMIT $1) s`,
			args...).Scan(&st.Expired); err != nil {
			return nil, fmt.Errorf("count expired rows of %s.%s: %w", schema, tbl.table, err)
		}
		st.Exact = st.Expired < capped
		r.Retention = append(r.Retention, st)
	}

	rows, err = pool.Query(ctx, `SELECT name, state, count(*), extract(epoch FROM now() - min(created_at))::float8 FROM `+t("saga")+`
		WHERE state IN ('running', 'compensating', 'stuck') GROUP BY name, state ORDER BY name, state`)
	if err != nil {
		return nil, fmt.Errorf("count sagas of schema %q: %w", schema, err)
	}
	r.Sagas, err = pgx.CollectRows(rows, pgx.RowToStructByPos[StatusSagas])
	if err != nil {
		return nil, fmt.Errorf("count sagas of schema %q: %w", schema, err)
	}
	// inbox_poison holds only given-up messages, which an operator deletes once handled: a
	// small table, counted in full.
	// Replayed rows are history, not problems; a replay request that waits long has no
	// process of its consumer to apply it.
	rows, err = pool.Query(ctx, `SELECT consumer, count(*) FILTER (WHERE state = 'poison'), count(*) FILTER (WHERE state = 'replay_requested'),
		coalesce(extract(epoch FROM now() - min(replay_requested_at) FILTER (WHERE state = 'replay_requested'))::float8, 0)
		FROM `+t("inbox_poison")+` WHERE state IN ('poison', 'replay_requested') GROUP BY consumer ORDER BY consumer`)
	if err != nil {
		return nil, fmt.Errorf("count poison messages of schema %q: %w", schema, err)
	}
	r.InboxPoison, err = pgx.CollectRows(rows, pgx.RowToStructByPos[StatusPoison])
	if err != nil {
		return nil, fmt.Errorf("count poison messages of schema %q: %w", schema, err)
	}
	sagas, err := saga.NewAdmin(schema)
	if err != nil {
		return nil, err
	}
	parked, err := sagas.ParkedByVersion(ctx, pool)
	if err != nil {
		return nil, err
	}
	r.AwaitingVersion = make([]StatusAwaiting, len(parked))
	for i, p := range parked {
		r.AwaitingVersion[i] = StatusAwaiting{Name: p.Name, Version: p.Version, Replies: p.Replies, Sagas: p.Sagas,
			OldestAgeSeconds: p.CheckedAt.Sub(p.Oldest).Seconds()}
	}
	r.SagaStatesNote = "finished sagas (completed, compensated) are not counted: `onceflow saga list` lists them"
	if th.MaxSagaAge > 0 {
		// Stuck sagas are not counted here: --max-stuck-sagas reports them.
		over := `FROM ` + t("saga") + ` WHERE state IN ('running', 'compensating') AND created_at < now() - make_interval(secs => $1)`
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT 1 `+over+` LIMIT $2) s`, th.MaxSagaAge.Seconds(), MaxSagasOverAge).
			Scan(&r.SagasOverAge); err != nil {
			return nil, fmt.Errorf("count long-running sagas of schema %q: %w", schema, err)
		}
		if r.SagasOverAge > 0 {
			var o StatusSaga
			err := pool.QueryRow(ctx, `SELECT id, name, state, extract(epoch FROM now() - created_at)::float8 `+over+
				` ORDER BY created_at LIMIT 1`, th.MaxSagaAge.Seconds()).Scan(&o.ID, &o.Name, &o.State, &o.AgeSeconds)
			switch {
			case err == nil:
				r.OldestSaga = &o
			case !errors.Is(err, pgx.ErrNoRows): // none when it finished in between
				return nil, fmt.Errorf("find the oldest running saga of schema %q: %w", schema, err)
			}
		}
	}
	if th.MaxTimerLag > 0 {
		// Due rows only, on saga_timer_due_at_idx, capped: cheap with any number of timers.
		due := `FROM ` + t("saga_timer") + ` WHERE due_at < now() - make_interval(secs => $1)`
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT 1 `+due+` LIMIT $2) s`, th.MaxTimerLag.Seconds(), MaxOverdueTimers).
			Scan(&r.OverdueTimers); err != nil {
			return nil, fmt.Errorf("count overdue saga timers of schema %q: %w", schema, err)
		}
		if r.OverdueTimers > 0 {
			var o StatusOverdueTimer
			err := pool.QueryRow(ctx, `SELECT t.saga_id, coalesce(s.name, ''), t.kind, t.action, extract(epoch FROM now() - t.due_at)::float8
				FROM `+t("saga_timer")+` t LEFT JOIN `+t("saga")+` s ON s.id = t.saga_id
				WHERE t.due_at < now() - make_interval(secs => $1) ORDER BY t.due_at LIMIT 1`, th.MaxTimerLag.Seconds()).
				Scan(&o.SagaID, &o.Name, &o.Kind, &o.Action, &o.OverdueSeconds)
			switch {
			case err == nil:
				r.OldestOverdue = &o
			case !errors.Is(err, pgx.ErrNoRows): // fired in between
				return nil, fmt.Errorf("find the most overdue saga timer of schema %q: %w", schema, err)
			}
		}
	}
	r.check()
	return r, nil
}

// check fills Problems and OK from the thresholds.
func (r *Status) check() {
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
	r.OK = len(r.Problems) == 0
}

// count is "1 row", "2 rows".
func count(n int64, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return fmt.Sprintf("%d %s", n, many)
}
