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

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/status"
)

// exitStuck is the status of `onceflow status` when a check failed, so a cron job, a
// Kubernetes probe or a deploy script can tell "stuck" (4) from "could not look" (1).
const exitStuck = 4

// statusReport is one look at a schema (status.Read, which the console's overview
// shows too); --json prints it as is.
type statusReport = status.Report

const statusSynopsis = `status [flags]

One screen for an operator: the relays (id, host, shards held, last heartbeat), the outbox
backlog and the age of its oldest row, parked rows, scheduled messages (how many, the next
due, the overdue ones), rows past retention in each dedup table,
sagas by state, overdue saga timers, saga replies parked awaiting an orchestrator with their
definition version, inbox messages given up as poison, and what waits in each inbox consumer's
retry lane (parked messages, their keys, the longest wait, the next due). Exits 4 when
something is stuck (see the --max-* thresholds), 0 when all is well, 1 when it could not look. --watch refreshes it; --json prints it for scripts
(one object per refresh).`

func (c *cli) runStatus(ctx context.Context, args []string) error {
	fs := c.newFlagSet("status", statusSynopsis)
	db := c.addDBFlags(fs)
	asJSON := fs.Bool("json", false, "print the report as JSON (one object per line with --watch)")
	watch := fs.Bool("watch", false, "refresh every --interval until interrupted")
	interval := fs.Duration("interval", 2*time.Second, "refresh interval of --watch")
	var th status.Thresholds
	fs.DurationVar(&th.MaxOldest, "max-oldest-age", 5*time.Minute, "stuck when the oldest pending row is older than this")
	fs.Int64Var(&th.MaxParked, "max-parked", 0, "stuck when more rows than this are parked")
	fs.DurationVar(&th.MaxHeartbeat, "max-heartbeat-age", time.Minute, "stuck when a live relay's last heartbeat is older than this")
	fs.Int64Var(&th.MaxRetention, "max-retention-backlog", 100_000, "stuck when a table holds more rows past retention than this (cleanup not running)")
	fs.Int64Var(&th.MaxStuckSagas, "max-stuck-sagas", 0, "stuck when more sagas than this are in state stuck")
	fs.DurationVar(&th.MaxSagaAge, "max-saga-age", time.Hour, "stuck when a saga is running or compensating for longer than this since its start (0: no check)")
	fs.Int64Var(&th.MaxPoison, "max-inbox-poison", 0, "stuck when more inbox messages than this were given up as poison (onceflow inbox poison)")
	fs.DurationVar(&th.MaxTimerLag, "max-timer-lag", time.Minute, "stuck when a saga timer or operator request (saga retry, compensate) is overdue by more than this: no orchestrator fires them (0: no check)")
	fs.DurationVar(&th.MaxVersionWait, "max-version-wait", 5*time.Minute, "stuck when a saga reply waits longer than this, parked, for an orchestrator with its saga's definition version: none running has it registered (0: no check)")
	fs.DurationVar(&th.MaxScheduledOverdue, "max-scheduled-overdue", time.Minute, "stuck when a scheduled message (outbox.DeliverAt) waits longer than this past its due time: no relay moves scheduled messages (0: no check)")
	fs.DurationVar(&th.MaxReplayWait, "max-replay-wait", time.Minute, "stuck when an inbox replay request (onceflow inbox poison replay) waits longer than this: no process of its consumer applies replays (0: no check)")
	fs.DurationVar(&th.MaxLaneWait, "max-lane-wait", time.Hour, "stuck when a key has waited longer than this in an inbox consumer's retry lane (inbox.RetryAfter): its provider may be down; onceflow inbox parked lists them (0: no check)")
	fs.DurationVar(&th.MaxLaneLag, "max-lane-lag", 5*time.Minute, "stuck when a message of an inbox consumer's retry lane is due longer ago than this and still parked: no process of that consumer applies the lane (0: no check)")
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
	th.Window = w
	if *interval <= 0 {
		problems = append(problems, fmt.Errorf("--interval is %s; it must be positive", *interval))
	}
	if th.MaxOldest <= 0 || th.MaxHeartbeat <= 0 {
		problems = append(problems, errors.New("--max-oldest-age and --max-heartbeat-age must be positive"))
	}
	if th.MaxParked < 0 || th.MaxRetention < 0 || th.MaxStuckSagas < 0 || th.MaxSagaAge < 0 || th.MaxPoison < 0 || th.MaxTimerLag < 0 || th.MaxReplayWait < 0 || th.MaxVersionWait < 0 || th.MaxScheduledOverdue < 0 ||
		th.MaxLaneWait < 0 || th.MaxLaneLag < 0 {
		problems = append(problems, errors.New("--max-parked, --max-retention-backlog, --max-stuck-sagas, --max-saga-age, --max-inbox-poison, --max-timer-lag, --max-replay-wait, --max-version-wait, --max-scheduled-overdue, --max-lane-wait and --max-lane-lag must be 0 or more"))
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
		r, err := status.Read(ctx, pool, db.schema, th)
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
			err = printStatus(c.stdout, r)
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

func printStatus(w io.Writer, r *statusReport) error {
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
	p.f("scheduled: %s\n", scheduledStatus(r.Scheduled, r.CheckedAt))
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
	if r.OverdueTimers > 0 {
		p.f("saga timers and operator requests overdue: %d\n", r.OverdueTimers)
	}
	if len(r.AwaitingVersion) > 0 {
		p.f("\nAWAITING VERSION\tPARKED REPLIES\tSAGAS\tOLDEST WAITS\n")
		for _, a := range r.AwaitingVersion {
			p.f("%s v%d\t%d\t%d\t%s\n", a.Name, a.Version, a.Replies, a.Sagas, time.Duration(a.OldestAgeSeconds*float64(time.Second)).Round(time.Second))
		}
	}
	if len(r.InboxPoison) > 0 {
		p.f("\nINBOX CONSUMER\tPOISON MESSAGES\tREPLAYS WAITING\tOLDEST WAITS\n")
		for _, ps := range r.InboxPoison {
			oldest := "-"
			if ps.ReplayRequested > 0 {
				oldest = time.Duration(ps.OldestRequestSeconds * float64(time.Second)).Round(time.Second).String()
			}
			p.f("%s\t%d\t%d\t%s\n", ps.Consumer, ps.Count, ps.ReplayRequested, oldest)
		}
	} else {
		p.f("no inbox messages given up as poison\n")
	}
	if len(r.RetryLane) > 0 {
		p.f("\nRETRY LANE\tPARKED\tKEYS\tLONGEST WAIT\tKEY\tNEXT DUE\n")
		for _, l := range r.RetryLane {
			key := l.OldestKey
			if key == "" {
				key = fmt.Sprintf("(none: row %d)", l.OldestID)
			}
			next := "-"
			if l.NextDue != nil {
				next = laneDue(l.NextDue, r.CheckedAt)
			}
			p.f("%s\t%s\t%s\t%s\t%s %s\t%s\n", l.Consumer, capped(l.Rows, l.RowsExact), capped(l.Keys, l.KeysExact),
				time.Duration(l.OldestAgeSeconds*float64(time.Second)).Round(time.Second), l.OldestTopic, key, next)
		}
	} else {
		p.f("no inbox messages parked in a retry lane\n")
	}
	return p.flush(tw)
}

// scheduledStatus is the scheduled line of the report: "none"; how many and the next due; or
// how many, the overdue ones and the most overdue.
func scheduledStatus(s status.Scheduled, now time.Time) string {
	if s.Rows == 0 {
		return "none"
	}
	about, more := "", ""
	if !s.RowsExact {
		about = "about "
	}
	if !s.OverdueExact {
		more = " or more"
	}
	line := about + plural(int(s.Rows), "message")
	switch {
	case s.Overdue > 0:
		line += fmt.Sprintf(", %d%s overdue, the most by %s (event %s)", s.Overdue, more,
			time.Duration(s.OldestOverdueSeconds*float64(time.Second)).Round(time.Second), s.OldestOverdueEventID)
	case s.NextDue != nil:
		line += fmt.Sprintf(", next due %s (%s), none overdue", fmtTime(*s.NextDue), dueIn(*s.NextDue, now))
	}
	return line
}

func boolInt(b bool) int64 {
	if b {
		return 1
	}
	return 0
}
