package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/relay"
)

const outboxSynopsis = `outbox inspect|find|parked|replay|scheduled [flags]

  inspect    pending rows, failing rows, parked count, shard leases and running relays
  find       where one event is: pending (attempts, last error), parked, scheduled (due
             when), or gone = published
  parked     rows the broker kept refusing, with the error that got them parked
  replay     move parked rows back into the outbox (same event id, fresh attempt count);
             select them with --id, --event-id, --topic, --key or --all
  scheduled  messages scheduled for later (outbox.DeliverAt), in due order; --count: how
             many, the next due, the overdue ones and the count by topic`

func (c *cli) runOutbox(ctx context.Context, args []string) error {
	if len(args) == 0 {
		c.outboxUsage(c.stderr)
		return errUsage
	}
	switch args[0] {
	case "inspect":
		return c.outboxInspect(ctx, args[1:])
	case "find":
		return c.outboxFind(ctx, args[1:]) // findcmd.go
	case "parked":
		return c.outboxParked(ctx, args[1:])
	case "replay":
		return c.outboxReplay(ctx, args[1:])
	case "scheduled":
		return c.outboxScheduled(ctx, args[1:]) // scheduledcmd.go
	case "-h", "-help", "--help", "help":
		c.outboxUsage(c.stdout)
		return flag.ErrHelp
	default:
		fmt.Fprintf(c.stderr, "onceflow outbox: unknown action %q\n\n", args[0])
		c.outboxUsage(c.stderr)
		return errUsage
	}
}

// outboxUsage prints the actions; each action has its own -h with its flags.
func (c *cli) outboxUsage(w io.Writer) {
	fmt.Fprintf(w, "Usage: onceflow %s\n\nRun 'onceflow outbox <action> -h' for the flags of an action.\n", outboxSynopsis)
}

// filterFlags are the row selectors shared by parked and replay.
type filterFlags struct {
	ids, eventIDs, topic, key string
}

func addFilterFlags(fs *flag.FlagSet) *filterFlags {
	f := &filterFlags{}
	fs.StringVar(&f.ids, "id", "", "comma-separated row ids, as listed by outbox parked")
	fs.StringVar(&f.eventIDs, "event-id", "", "comma-separated event ids (UUIDs)")
	fs.StringVar(&f.topic, "topic", "", "only rows of this topic")
	fs.StringVar(&f.key, "key", "", "only rows with this partition key")
	return f
}

func (f *filterFlags) filter() (relay.ParkedFilter, error) {
	pf := relay.ParkedFilter{Topic: f.topic, Key: f.key}
	ids, err := parseRowIDs(f.ids)
	if err != nil {
		return pf, err
	}
	pf.IDs = ids
	var bad []string
	for _, s := range splitList(f.eventIDs) {
		if _, err := uuid.Parse(s); err != nil {
			bad = append(bad, strconv.Quote(s))
		}
		pf.EventIDs = append(pf.EventIDs, s)
	}
	if len(bad) > 0 {
		return pf, fmt.Errorf("--event-id: not event ids (UUIDs): %s", strings.Join(bad, ", "))
	}
	return pf, nil
}

// parseRowIDs reads --id's comma-separated row ids, each once. Ids start at 1: --id 0 is a
// typo, not a filter, and is refused with the rest of what is not an id.
func parseRowIDs(text string) ([]int64, error) {
	var ids []int64
	var bad []string
	for _, s := range splitList(text) {
		id, err := strconv.ParseInt(s, 10, 64)
		if err != nil || id < 1 {
			bad = append(bad, strconv.Quote(s))
			continue
		}
		if !slices.Contains(ids, id) {
			ids = append(ids, id)
		}
	}
	if len(bad) > 0 {
		return nil, fmt.Errorf("--id: not row ids: %s", strings.Join(bad, ", "))
	}
	return ids, nil
}

func splitList(s string) []string {
	var out []string
	for _, part := range strings.Split(s, ",") {
		if part = strings.TrimSpace(part); part != "" {
			out = append(out, part)
		}
	}
	return out
}

func (c *cli) outboxInspect(ctx context.Context, args []string) error {
	fs := c.newFlagSet("outbox inspect", "outbox inspect [flags]\n\nShows what waits in the outbox and which relays hold the shards.")
	db := c.addDBFlags(fs)
	limit := addLimitFlag(fs, 20, "pending rows (oldest first)")
	topic := fs.String("topic", "", "list only rows of this topic")
	failing := fs.Bool("failing", false, "list only rows the broker refused at least once")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := checkLimit(*limit); err != nil {
		return err
	}
	admin, err := relay.NewAdmin(db.schema)
	if err != nil {
		return err
	}
	pool, err := db.connectMigrated(ctx, "onceflow-outbox")
	if err != nil {
		return err
	}
	defer pool.Close()
	s, err := admin.Summary(ctx, pool)
	if err != nil {
		return err
	}
	// One tabwriter for everything: a line without tabs ends a table, so each section is
	// aligned on its own.
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	p := &printer{w: tw}
	p.f("schema %q at %s\n", db.schema, s.CheckedAt.UTC().Format(time.RFC3339))
	oldest := ""
	if s.Pending > 0 && !s.Oldest.IsZero() {
		oldest = " (oldest " + s.CheckedAt.Sub(s.Oldest).Round(time.Millisecond).String() + " old)"
	}
	about, among := "", ""
	if !s.PendingExact {
		about = "about "
	}
	if s.Pending > relay.SummarySample {
		among = fmt.Sprintf(" of the oldest %d", relay.SummarySample)
	}
	p.f("pending: %s%d rows%s, %d%s refused at least once; parked: %d\n", about, s.Pending, oldest, s.Failing, among, s.Parked)
	if s.Pending > 0 && !slices.ContainsFunc(s.Members, func(m relay.Member) bool { return m.Live }) {
		// On stderr, so it shows in a terminal and stays out of a script's parsing of the report.
		fmt.Fprintf(c.stderr, "onceflow outbox: warning: %d rows pending and no relay is live (no unexpired heartbeat in relay_member), so nothing publishes them: start one with `onceflow relay --schema %s`\n",
			s.Pending, db.schema)
	}
	if len(s.PerTopic) > 0 {
		if among != "" {
			p.f("\nper topic, among the oldest %d rows:", relay.SummarySample)
		}
		p.f("\nTOPIC\tPENDING\n")
		for _, t := range s.PerTopic {
			p.f("%s\t%d\n", t.Topic, t.Pending)
		}
	}
	p.f("\nshards: %d\n", s.Shards)
	if len(s.Leases) > 0 {
		p.f("OWNER\tSHARDS\tLIVE\tEARLIEST EXPIRY\n")
		for _, l := range s.Leases {
			owner := l.Owner
			if owner == "" {
				owner = "(free)"
			}
			p.f("%s\t%d\t%t\t%s\n", owner, l.Shards, l.Live, fmtTime(l.ExpiresAt))
		}
	}
	if len(s.Members) > 0 {
		p.f("\nRELAY\tHOST\tPID\tLIVE\tSTARTED\tLAST HEARTBEAT\n")
		for _, m := range s.Members {
			p.f("%s\t%s\t%d\t%t\t%s\t%s\n", m.ID, m.Host, m.PID, m.Live, fmtTime(m.StartedAt), fmtTime(m.HeartbeatAt))
		}
	}
	rows, err := admin.Pending(ctx, pool, relay.PendingFilter{Topic: *topic, Failing: *failing, Limit: *limit})
	if err != nil {
		return err
	}
	if len(rows) > 0 {
		p.f("\nID\tEVENT ID\tTOPIC\tKEY\tBYTES\tCREATED\tATTEMPTS\tLAST ERROR\n")
		for _, r := range rows {
			p.f("%d\t%s\t%s\t%s\t%d\t%s\t%d\t%s\n", r.ID, r.EventID, r.Topic, r.Key, r.Size, fmtTime(r.CreatedAt), r.Attempts, oneLine(r.LastError))
		}
	}
	return p.flush(tw)
}

// printer remembers the first write error, so a long report checks it once.
type printer struct {
	w   io.Writer
	err error
}

func (p *printer) f(format string, args ...any) {
	if p.err == nil {
		_, p.err = fmt.Fprintf(p.w, format, args...)
	}
}

func (p *printer) flush(tw *tabwriter.Writer) error {
	if p.err != nil {
		return p.err
	}
	return tw.Flush()
}

func (c *cli) outboxParked(ctx context.Context, args []string) error {
	fs := c.newFlagSet("outbox parked", "outbox parked [flags]\n\nLists parked rows, oldest first, with the error that got them parked.")
	db := c.addDBFlags(fs)
	ff := addFilterFlags(fs)
	limit := addLimitFlag(fs, 100, "rows")
	after := fs.Int64("after", 0, "list the rows after this id (the next page of a listing)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := checkLimit(*limit); err != nil {
		return err
	}
	f, err := ff.filter()
	if err != nil {
		return err
	}
	f.Limit, f.AfterID = *limit, *after
	admin, err := relay.NewAdmin(db.schema)
	if err != nil {
		return err
	}
	pool, err := db.connectMigrated(ctx, "onceflow-outbox")
	if err != nil {
		return err
	}
	defer pool.Close()
	rows, err := admin.Parked(ctx, pool, f)
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	p := &printer{w: tw}
	if len(rows) == 0 {
		p.f("no parked rows\n")
	} else {
		p.f("ID\tEVENT ID\tTOPIC\tKEY\tBYTES\tATTEMPTS\tPARKED\tBY\tERROR\n")
	}
	for _, r := range rows {
		p.f("%d\t%s\t%s\t%s\t%d\t%d\t%s\t%s\t%s\n", r.ID, r.EventID, r.Topic, r.Key, r.Size, r.Attempts, fmtTime(r.ParkedAt), r.ParkedBy, oneLine(r.LastError))
	}
	if len(rows) == *limit {
		p.f("\nmore may follow: --after %d lists the next page\n", rows[len(rows)-1].ID)
	}
	return p.flush(tw)
}

func (c *cli) outboxReplay(ctx context.Context, args []string) error {
	fs := c.newFlagSet("outbox replay", "outbox replay (--id ...|--event-id ...|--topic ...|--key ...|--all) [flags]\n\n"+
		"Moves parked rows back into the outbox with their event id, payload and metadata; relays\n"+
		"publish them after the rows already waiting (a key whose row was parked is out of order\n"+
		"anyway). Filters combine with AND.")
	db := c.addDBFlags(fs)
	ff := addFilterFlags(fs)
	all := fs.Bool("all", false, "replay every parked row (needed when no other filter is given)")
	dryRun := fs.Bool("dry-run", false, "list what would be replayed and change nothing")
	if err := parse(fs, args); err != nil {
		return err
	}
	f, err := ff.filter()
	if err != nil {
		return err
	}
	f.All = *all
	admin, err := relay.NewAdmin(db.schema)
	if err != nil {
		return err
	}
	if !f.All && len(f.IDs) == 0 && len(f.EventIDs) == 0 && f.Topic == "" && f.Key == "" {
		return fmt.Errorf("nothing selected: pass --id, --event-id, --topic or --key, or --all to replay every parked row")
	}
	pool, err := db.connectMigrated(ctx, "onceflow-outbox")
	if err != nil {
		return err
	}
	defer pool.Close()
	p := &printer{w: c.stdout}
	if *dryRun {
		// A count that stops at replayDryRunCap and the first ids: a dry run over a million
		// parked rows reads no more than that, and prints a screen, not a million lines.
		n, ids, err := admin.CountParked(ctx, pool, f, replayDryRunCap, dryRunIDs)
		if err != nil {
			return err
		}
		if n == 0 {
			return fmt.Errorf("no parked row matches %s (dry run): nothing would be replayed; `onceflow outbox parked` lists them", ff.describe(f.All))
		}
		more := ""
		if n >= replayDryRunCap {
			more = " or more"
		}
		p.f("%d%s parked rows would be replayed (dry run: nothing changed); ids", n, more)
		for i, id := range ids {
			sep := ","
			if i == 0 {
				sep = ":"
			}
			p.f("%s %d", sep, id)
		}
		if int64(len(ids)) < n {
			p.f(", … (the first %d shown)", len(ids))
		}
		p.f("\n")
		return p.err
	}
	var done []relay.Replayed
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		done, err = admin.ReplayTx(ctx, tx, f)
		return err
	})
	if err != nil {
		return err
	}
	if len(done) == 0 {
		return fmt.Errorf("no parked row matches %s: nothing moved; `onceflow outbox parked` lists them", ff.describe(f.All))
	}
	for _, r := range done {
		p.f("replayed event %s as outbox row %d\n", r.EventID, r.ID)
	}
	p.f("%d parked rows moved back into the outbox\n", len(done))
	return p.err
}

// The dry run's bounds: the count stops at replayDryRunCap, and the first dryRunIDs ids are
// printed.
const (
	replayDryRunCap = 100_000
	dryRunIDs       = 1000
)

// describe says which filter selected nothing, for the error that says so.
func (f *filterFlags) describe(all bool) string {
	var parts []string
	for _, p := range []struct{ flag, v string }{{"--id", f.ids}, {"--event-id", f.eventIDs}, {"--topic", f.topic}, {"--key", f.key}} {
		if p.v != "" {
			parts = append(parts, fmt.Sprintf("%s %q", p.flag, p.v))
		}
	}
	if all && len(parts) == 0 {
		return "--all (there are no parked rows)"
	}
	return strings.Join(parts, " ")
}

func fmtTime(t time.Time) string {
	if t.IsZero() || t.Unix() <= 0 || t.Year() > 9999 { // 'epoch' marks a free lease
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05.000Z")
}

func oneLine(s string) string {
	s = strings.ReplaceAll(s, "\n", " ")
	if len(s) > 160 {
		s = s[:160] + "…"
	}
	return s
}
