package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/relay"
)

// exitStuck is the status of `onceflow status` when a check failed, so a cron job, a
// Kubernetes probe or a deploy script can tell "stuck" (4) from "could not look" (1).
const exitStuck = 4

// statusThresholds decide when `onceflow status` reports something stuck.
type statusThresholds struct {
	maxOldest     time.Duration // oldest pending row older than this
	maxParked     int64         // more parked rows than this
	maxHeartbeat  time.Duration // a relay's last heartbeat older than this while its row is live
	maxRetention  int64         // more rows past the retention window than this, in any table
	maxStuckSagas int64         // more sagas in state stuck than this
	maxSagaAge    time.Duration // a saga running or compensating for longer than this (0: off)
	maxPoison     int64         // more rows in inbox_poison than this
	window        time.Duration // the retention window of processed_event and finished sagas
}

// statusReport is one look at a schema; --json prints it as is.
type statusReport struct {
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
	Relays        []statusRelay `json:"relays"`
	Retention     []statusTable `json:"retention"`
	Sagas         []statusSagas `json:"sagas"`
	// InboxPoison counts the messages batched consumers gave up on (inbox_poison), per
	// consumer; `onceflow inbox poison` lists them.
	InboxPoison    []statusPoison `json:"inbox_poison"`
	SagaStatesNote string         `json:"sagas_note,omitempty"`
	// SagasOverAge counts sagas running or compensating for longer than --max-saga-age
	// (capped, like the retention counts); OldestSaga is the oldest of them.
	SagasOverAge int64       `json:"sagas_over_age"`
	OldestSaga   *statusSaga `json:"oldest_saga,omitempty"`
	thresholds   statusThresholds
}

type statusRelay struct {
	ID                  string    `json:"id"`
	Host                string    `json:"host"`
	PID                 int       `json:"pid"`
	Shards              int       `json:"shards"`
	Live                bool      `json:"live"`
	HeartbeatAt         time.Time `json:"heartbeat_at"`
	HeartbeatAgeSeconds float64   `json:"heartbeat_age_seconds"`
}

type statusTable struct {
	Table string `json:"table"`
	// Rule says which rows are past retention.
	Rule string `json:"rule"`
	// Expired rows the cleaner may delete but has not yet; counted up to a cap (Exact false
	// above it).
	Expired int64 `json:"expired"`
	Exact   bool  `json:"exact"`
}

type statusPoison struct {
	Consumer string `json:"consumer"`
	Count    int64  `json:"count"`
}

type statusSagas struct {
	Name  string `json:"name"`
	State string `json:"state"`
	Count int64  `json:"count"`
	// OldestAgeSeconds is the time since the oldest of them started.
	OldestAgeSeconds float64 `json:"oldest_age_seconds"`
}

// statusSaga is one saga that has been running for too long.
type statusSaga struct {
	ID         string  `json:"id"`
	Name       string  `json:"name"`
	State      string  `json:"state"`
	AgeSeconds float64 `json:"age_seconds"`
}

// maxSagasOverAge caps the count of sagas over --max-saga-age, so the check costs the same
// with a million of them.
const maxSagasOverAge = 1000

const statusSynopsis = `status [flags]

One screen for an operator: the relays (id, host, shards held, last heartbeat), the outbox
backlog and the age of its oldest row, parked rows, rows past retention in each dedup table,
sagas by state, and inbox messages given up as poison. Exits 4 when something is stuck (see the --max-* thresholds), 0 when
all is well, 1 when it could not look. --watch refreshes it; --json prints it for scripts
(one object per refresh).`

func (c *cli) runStatus(ctx context.Context, args []string) error {
	fs := c.newFlagSet("status", statusSynopsis)
	db := c.addDBFlags(fs)
	asJSON := fs.Bool("json", false, "print the report as JSON (one object per line with --watch)")
	watch := fs.Bool("watch", false, "refresh every --interval until interrupted")
	interval := fs.Duration("interval", 2*time.Second, "refresh interval of --watch")
	var th statusThresholds
	fs.DurationVar(&th.maxOldest, "max-oldest-age", 5*time.Minute, "stuck when the oldest pending row is older than this")
	fs.Int64Var(&th.maxParked, "max-parked", 0, "stuck when more rows than this are parked")
	fs.DurationVar(&th.maxHeartbeat, "max-heartbeat-age", time.Minute, "stuck when a live relay's last heartbeat is older than this")
	fs.Int64Var(&th.maxRetention, "max-retention-backlog", 100_000, "stuck when a table holds more rows past retention than this (cleanup not running)")
	fs.Int64Var(&th.maxStuckSagas, "max-stuck-sagas", 0, "stuck when more sagas than this are in state stuck")
	fs.DurationVar(&th.maxSagaAge, "max-saga-age", time.Hour, "stuck when a saga is running or compensating for longer than this since its start (0: no check)")
	fs.Int64Var(&th.maxPoison, "max-inbox-poison", 0, "stuck when more inbox messages than this were given up as poison (onceflow inbox poison)")
	windowText := fs.String("window", c.envOr("ONCEFLOW_RETENTION_WINDOW", strings.TrimSuffix(inbox.DefaultWindow.String(), "0m0s")),
		"retention window of processed_event and finished sagas, as given to cleanup [ONCEFLOW_RETENTION_WINDOW]")
	if err := parse(fs, args); err != nil {
		return err
	}
	var problems []error
	w, err := time.ParseDuration(*windowText)
	if err != nil || w <= 0 {
		problems = append(problems, fmt.Errorf("--window %q is not a positive duration (e.g. 72h)", *windowText))
	}
	th.window = w
	if *interval <= 0 {
		problems = append(problems, fmt.Errorf("--interval is %s; it must be positive", *interval))
	}
	if th.maxOldest <= 0 || th.maxHeartbeat <= 0 {
		problems = append(problems, errors.New("--max-oldest-age and --max-heartbeat-age must be positive"))
	}
	if th.maxParked < 0 || th.maxRetention < 0 || th.maxStuckSagas < 0 || th.maxSagaAge < 0 || th.maxPoison < 0 {
		problems = append(problems, errors.New("--max-parked, --max-retention-backlog, --max-stuck-sagas, --max-saga-age and --max-inbox-poison must be 0 or more"))
	}
	if fs.NArg() > 0 {
		problems = append(problems, fmt.Errorf("unexpected arguments %q", fs.Args()))
	}
	if err := errors.Join(problems...); err != nil {
		return err
	}
	pool, err := db.connectMigrated(ctx, "onceflow-status")
	if err != nil {
		return err
	}
	defer pool.Close()
	for {
		r, err := readStatus(ctx, pool, db.schema, th)
		if err != nil {
			if *watch && ctx.Err() != nil {
				return nil
			}
			return err
		}
		if *asJSON {
			b, _ := json.Marshal(r)
			_, err = fmt.Fprintf(c.stdout, "%s\n", b)
		} else {
			if *watch {
				_, _ = io.WriteString(c.stdout, "\033[H\033[2J") // clear the terminal
			}
			err = r.print(c.stdout)
		}
		if err != nil {
			return err
		}
		if !*watch {
			if !r.OK {
				return &exitError{code: exitStuck, err: fmt.Errorf("stuck: %s", strings.Join(r.Problems, "; "))}
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(*interval):
		}
	}
}

// readStatus reads everything with queries whose cost does not grow with the backlog: the
// outbox through relay.Admin.Backlog, retention backlogs as counts capped just above the
// threshold (on the age indexes), sagas by state on saga_state_idx without the finished
// states (which retention keeps by the million).
func readStatus(ctx context.Context, pool *pgxpool.Pool, schema string, th statusThresholds) (*statusReport, error) {
	admin, err := relay.NewAdmin(schema)
	if err != nil {
		return nil, err
	}
	b, err := admin.Backlog(ctx, pool)
	if err != nil {
		return nil, err
	}
	r := &statusReport{Schema: schema, CheckedAt: b.CheckedAt, thresholds: th, Problems: []string{}}
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
	r.Relays, err = pgx.CollectRows(rows, pgx.RowToStructByPos[statusRelay])
	if err != nil {
		return nil, fmt.Errorf("read relays of schema %q: %w", schema, err)
	}

	capped := th.maxRetention + 1
	for _, tbl := range []struct{ table, rule, where string }{
		{"processed_event", "processed_at older than the window", "processed_at < now() - make_interval(secs => $2)"},
		{"idempotency_record", "expires_at passed", "expires_at < now()"},
		{"saga", "finished longer than the window ago", "finished_at < now() - make_interval(secs => $2)"},
	} {
		st := statusTable{Table: tbl.table, Rule: tbl.rule}
		args := []any{capped}
		if strings.Contains(tbl.where, "$2") {
			args = append(args, th.window.Seconds())
		}
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT 1 FROM `+t(tbl.table)+` WHERE `+tbl.where+` LIMIT $1) s`,
			args...).Scan(&st.Expired); err != nil {
			return nil, fmt.Errorf("count expired rows of %s.%s: %w", schema, tbl.table, err)
		}
		st.Exact = st.Expired < capped
		r.Retention = append(r.Retention, st)
	}

	rows, err = pool.Query(ctx, `SELECT name, state, count(*), extract(epoch FROM now() - min(created_at))::float8 FROM `+t("saga")+`
		WHERE state NOT IN ('completed', 'compensated') GROUP BY name, state ORDER BY name, state`)
	if err != nil {
		return nil, fmt.Errorf("count sagas of schema %q: %w", schema, err)
	}
	r.Sagas, err = pgx.CollectRows(rows, pgx.RowToStructByPos[statusSagas])
	if err != nil {
		return nil, fmt.Errorf("count sagas of schema %q: %w", schema, err)
	}
	// inbox_poison holds only given-up messages, which an operator deletes once handled: a
	// small table, counted in full.
	rows, err = pool.Query(ctx, `SELECT consumer, count(*) FROM `+t("inbox_poison")+` GROUP BY consumer ORDER BY consumer`)
	if err != nil {
		return nil, fmt.Errorf("count poison messages of schema %q: %w", schema, err)
	}
	r.InboxPoison, err = pgx.CollectRows(rows, pgx.RowToStructByPos[statusPoison])
	if err != nil {
		return nil, fmt.Errorf("count poison messages of schema %q: %w", schema, err)
	}
	r.SagaStatesNote = "finished sagas (completed, compensated) are not counted: `onceflow saga list` lists them"
	if th.maxSagaAge > 0 {
		// Stuck sagas are not counted here: --max-stuck-sagas reports them.
		over := `FROM ` + t("saga") + ` WHERE state IN ('running', 'compensating') AND created_at < now() - make_interval(secs => $1)`
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT 1 `+over+` LIMIT $2) s`, th.maxSagaAge.Seconds(), maxSagasOverAge).
			Scan(&r.SagasOverAge); err != nil {
			return nil, fmt.Errorf("count long-running sagas of schema %q: %w", schema, err)
		}
		if r.SagasOverAge > 0 {
			var o statusSaga
			err := pool.QueryRow(ctx, `SELECT id, name, state, extract(epoch FROM now() - created_at)::float8 `+over+
				` ORDER BY created_at LIMIT 1`, th.maxSagaAge.Seconds()).Scan(&o.ID, &o.Name, &o.State, &o.AgeSeconds)
			switch {
			case err == nil:
				r.OldestSaga = &o
			case !errors.Is(err, pgx.ErrNoRows): // none when it finished in between
				return nil, fmt.Errorf("find the oldest running saga of schema %q: %w", schema, err)
			}
		}
	}
	r.check()
	return r, nil
}

// check fills Problems and OK from the thresholds.
func (r *statusReport) check() {
	th := r.thresholds
	add := func(format string, args ...any) { r.Problems = append(r.Problems, fmt.Sprintf(format, args...)) }
	oldest := time.Duration(r.Outbox.OldestAgeSeconds * float64(time.Second))
	live := 0
	for _, rl := range r.Relays {
		if rl.Live {
			live++
			if age := time.Duration(rl.HeartbeatAgeSeconds * float64(time.Second)); age > th.maxHeartbeat {
				add("relay %q on %s last beat %s ago (over %s): it is hung or cannot reach the database; check its logs", rl.ID, rl.Host, age.Round(time.Second), th.maxHeartbeat)
			}
		}
	}
	if r.Outbox.Pending > 0 && live == 0 {
		add("%d rows pending and no live relay: start one (`onceflow relay --schema %s`)", r.Outbox.Pending, r.Schema)
	}
	if oldest > th.maxOldest {
		add("the oldest pending row (id %d) waits for %s (over %s): `onceflow outbox inspect --failing` shows refused rows, the relay logs say why", r.Outbox.OldestID, oldest.Round(time.Second), th.maxOldest)
	}
	if r.Outbox.Parked > th.maxParked {
		add("%d rows parked (over %d): `onceflow outbox parked` shows why, `onceflow outbox replay` sends them again", r.Outbox.Parked, th.maxParked)
	}
	for _, t := range r.Retention {
		if t.Expired > th.maxRetention {
			add("%s holds more than %d rows past retention: is `onceflow cleanup` scheduled?", t.Table, th.maxRetention)
		}
	}
	var stuck int64
	for _, s := range r.Sagas {
		if s.State == "stuck" {
			stuck += s.Count
		}
	}
	if stuck > th.maxStuckSagas {
		add("%d sagas stuck (over %d): `onceflow saga list --state stuck`, then `onceflow saga retry`", stuck, th.maxStuckSagas)
	}
	if r.SagasOverAge > 0 && r.OldestSaga != nil {
		more := ""
		if r.SagasOverAge >= maxSagasOverAge {
			more = " or more"
		}
		o := r.OldestSaga
		add("%d%s sagas running or compensating for longer than %s; the oldest, %s (%s), is %s for %s: `onceflow saga show %s` says what it waits for",
			r.SagasOverAge, more, th.maxSagaAge, o.ID, o.Name, o.State, time.Duration(o.AgeSeconds*float64(time.Second)).Round(time.Second), o.ID)
	}
	var poison int64
	for _, p := range r.InboxPoison {
		poison += p.Count
	}
	if poison > th.maxPoison {
		add("%d inbox messages given up as poison (over %d): `onceflow inbox poison` shows them and why", poison, th.maxPoison)
	}
	r.OK = len(r.Problems) == 0
}

func (r *statusReport) print(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	p := &printer{w: tw}
	verdict := "OK"
	if !r.OK {
		verdict = "STUCK"
	}
	p.f("onceflow status — schema %q at %s: %s\n", r.Schema, r.CheckedAt.UTC().Format(time.RFC3339), verdict)
	for _, pr := range r.Problems {
		p.f("  ! %s\n", pr)
	}
	approx := ""
	if !r.Outbox.PendingExact {
		approx = "about "
	}
	oldest := "-"
	if r.Outbox.OldestID > 0 {
		oldest = fmt.Sprintf("%s (id %d)", time.Duration(r.Outbox.OldestAgeSeconds*float64(time.Second)).Round(time.Millisecond), r.Outbox.OldestID)
	}
	p.f("\noutbox: %s%d pending, oldest %s; parked: %d\n", approx, r.Outbox.Pending, oldest, r.Outbox.Parked)
	p.f("shards: %d, %d without a live owner\n", r.Shards, r.ShardsUnowned)
	if len(r.Relays) > 0 {
		p.f("\nRELAY\tHOST\tPID\tSHARDS\tLIVE\tLAST HEARTBEAT\n")
		for _, rl := range r.Relays {
			p.f("%s\t%s\t%d\t%d\t%t\t%s ago\n", rl.ID, rl.Host, rl.PID, rl.Shards, rl.Live, time.Duration(rl.HeartbeatAgeSeconds*float64(time.Second)).Round(time.Millisecond))
		}
	} else {
		p.f("no relay has ever run on this schema\n")
	}
	p.f("\nRETENTION\tPAST RETENTION\tRULE\n")
	for _, t := range r.Retention {
		more := ""
		if !t.Exact {
			more = "+"
		}
		p.f("%s\t%d%s\t%s\n", t.Table, t.Expired-boolInt(!t.Exact), more, t.Rule)
	}
	if len(r.Sagas) > 0 {
		p.f("\nSAGA\tSTATE\tCOUNT\tOLDEST\n")
		for _, s := range r.Sagas {
			p.f("%s\t%s\t%d\t%s\n", s.Name, s.State, s.Count, time.Duration(s.OldestAgeSeconds*float64(time.Second)).Round(time.Second))
		}
	} else {
		p.f("\nno running, compensating or stuck sagas\n")
	}
	if len(r.InboxPoison) > 0 {
		p.f("\nINBOX CONSUMER\tPOISON MESSAGES\n")
		for _, ps := range r.InboxPoison {
			p.f("%s\t%d\n", ps.Consumer, ps.Count)
		}
	} else {
		p.f("no inbox messages given up as poison\n")
	}
	return p.flush(tw)
}

func boolInt(b bool) int64 {
	if b {
		return 1
	}
	return 0
}
