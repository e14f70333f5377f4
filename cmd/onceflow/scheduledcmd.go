package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/onceflow/onceflow/relay"
)

const scheduledSynopsis = `outbox scheduled [flags]

Lists the messages scheduled for later (outbox.DeliverAt, outbox.DeliverAfter) that wait in
outbox_scheduled, in due order, a page at a time (--limit; the next page with the --after it
prints). A relay moves each into the outbox at its due time and publishes it within about a
second; one still waiting more than 5s after its time is overdue: no relay moves them (none
runs, or they predate scheduled messages). outbox.CancelTx withdraws a message until then.

--count shows the figures instead: how many are scheduled (exact up to 10000, an estimate
above), the next due, the overdue ones, and the count by topic of the next 10000 due (--all:
of every row, which reads the whole table: 0.5s or more at a million rows).`

// scheduledJSON is a page of `outbox scheduled --json`.
type scheduledJSON struct {
	Messages []scheduledMessageJSON `json:"messages"`
	// Next is the --after of the following page ("" when this page is the last); Searched is
	// set when a --topic filter stopped after reading that many rows without filling the page.
	Next     string `json:"next,omitempty"`
	Searched int    `json:"searched,omitempty"`
}

type scheduledMessageJSON struct {
	EventID   string            `json:"event_id"`
	Topic     string            `json:"topic"`
	Key       string            `json:"key"`
	Bytes     int               `json:"bytes"`
	DueAt     time.Time         `json:"due_at"`
	CreatedAt time.Time         `json:"created_at"`
	Metadata  map[string]string `json:"metadata"`
}

// scheduledCountJSON is `outbox scheduled --count --json`.
type scheduledCountJSON struct {
	Schema    string     `json:"schema"`
	CheckedAt time.Time  `json:"checked_at"`
	Rows      int64      `json:"rows"`
	RowsExact bool       `json:"rows_exact"`
	NextDue   *time.Time `json:"next_due,omitempty"`
	NextEvent string     `json:"next_event_id,omitempty"`
	NextTopic string     `json:"next_topic,omitempty"`
	// Overdue counts the messages due more than 5s ago (up to 10000: OverdueExact false above).
	Overdue      int64 `json:"overdue"`
	OverdueExact bool  `json:"overdue_exact"`
	// PerTopic counts the next PerTopicOf messages in due order by topic; PerTopicOf is 0 when
	// it counts every row (--all).
	PerTopic   []scheduledTopicJSON `json:"per_topic"`
	PerTopicOf int                  `json:"per_topic_of"`
}

type scheduledTopicJSON struct {
	Topic   string    `json:"topic"`
	Rows    int64     `json:"rows"`
	NextDue time.Time `json:"next_due"`
}

func (c *cli) outboxScheduled(ctx context.Context, args []string) error {
	fs := c.newFlagSet("outbox scheduled", scheduledSynopsis)
	db := c.addDBFlags(fs)
	topic := fs.String("topic", "", "list only messages of this topic (each page searches at most 20000 messages in due order)")
	limit := addLimitFlag(fs, 100, "messages (in due order)")
	after := fs.String("after", "", "list the page after this cursor (printed at the end of the previous page)")
	count := fs.Bool("count", false, "show how many are scheduled, the next due, the overdue ones and the count by topic, not the messages")
	all := fs.Bool("all", false, "with --count: count every scheduled message by topic, not only the next 10000 (reads the whole table)")
	asJSON := fs.Bool("json", false, "print the page (or with --count the figures) as JSON")
	if err := parse(fs, args); err != nil {
		return err
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var problems []error
	if fs.NArg() > 0 {
		problems = append(problems, fmt.Errorf("unexpected arguments %q (filter with --topic)", fs.Args()))
	}
	if *count && (set["topic"] || set["after"] || set["limit"]) {
		problems = append(problems, errors.New("--count counts every topic: --topic, --after and --limit are for the listing"))
	}
	if *all && !*count {
		problems = append(problems, errors.New("--all counts every message by topic: use it with --count"))
	}
	if err := checkLimit(*limit); err != nil {
		problems = append(problems, err)
	}
	if err := errors.Join(problems...); err != nil {
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
	s, err := admin.ScheduledSummary(ctx, pool)
	if err != nil {
		return err
	}
	if *count {
		sample := relay.ScheduledSample
		if *all {
			sample = 0
		}
		topics, err := admin.ScheduledPerTopic(ctx, pool, sample)
		if err != nil {
			return err
		}
		return c.printScheduledCount(db.schema, s, topics, sample, *asJSON)
	}
	page, err := admin.Scheduled(ctx, pool, relay.ScheduledFilter{Topic: *topic, After: *after, Limit: *limit})
	if errors.Is(err, relay.ErrBadScheduledCursor) {
		return fmt.Errorf("--after %q is not a cursor a listing printed: pass the one at the end of the previous page", *after)
	}
	if err != nil {
		return err
	}
	if *asJSON {
		out := scheduledJSON{Messages: []scheduledMessageJSON{}, Next: page.Next, Searched: page.Searched}
		for _, m := range page.Messages {
			out.Messages = append(out.Messages, scheduledMessageJSON{EventID: m.EventID, Topic: m.Topic, Key: m.Key, Bytes: m.Size,
				DueAt: m.DueAt, CreatedAt: m.CreatedAt, Metadata: m.Metadata})
		}
		b, _ := json.Marshal(out)
		_, err := fmt.Fprintf(c.stdout, "%s\n", b)
		return err
	}
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	p := &printer{w: tw}
	p.f("schema %q at %s: %s\n", db.schema, s.CheckedAt.UTC().Format(time.RFC3339), scheduledLine(s))
	if len(page.Messages) == 0 && page.Searched == 0 {
		what, where := "scheduled messages", ""
		if *topic != "" {
			what = fmt.Sprintf("scheduled message of topic %q", *topic)
		}
		if *after != "" {
			where = " after the cursor"
		}
		p.f("no %s%s\n", what, where)
	}
	if len(page.Messages) > 0 {
		p.f("\nEVENT ID\tTOPIC\tKEY\tBYTES\tDUE\tIN\tWRITTEN\n")
		for _, m := range page.Messages {
			p.f("%s\t%s\t%s\t%d\t%s\t%s\t%s\n", m.EventID, m.Topic, m.Key, m.Size, fmtTime(m.DueAt), dueIn(m.DueAt, s.CheckedAt), fmtTime(m.CreatedAt))
		}
	}
	switch {
	case page.Searched > 0:
		p.f("\nsearched the next %d scheduled messages for topic %q and stopped (no index holds the topic); more may match: add --after %s to search on\n",
			page.Searched, *topic, page.Next)
	case page.Next != "":
		p.f("\nmore scheduled messages follow: add --after %s for the next page\n", page.Next)
	}
	return p.flush(tw)
}

// printScheduledCount prints --count: the figures of s and the count by topic.
func (c *cli) printScheduledCount(schema string, s relay.ScheduledSummary, topics []relay.ScheduledTopicCount, sample int, asJSON bool) error {
	if asJSON {
		out := scheduledCountJSON{Schema: schema, CheckedAt: s.CheckedAt, Rows: s.Rows, RowsExact: s.Exact, NextEvent: s.NextEventID,
			NextTopic: s.NextTopic, Overdue: s.Overdue, OverdueExact: !s.OverdueCapped, PerTopic: []scheduledTopicJSON{}, PerTopicOf: sample}
		if !s.NextDue.IsZero() {
			out.NextDue = &s.NextDue
		}
		for _, t := range topics {
			out.PerTopic = append(out.PerTopic, scheduledTopicJSON(t))
		}
		b, _ := json.Marshal(out)
		_, err := fmt.Fprintf(c.stdout, "%s\n", b)
		return err
	}
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	p := &printer{w: tw}
	p.f("schema %q at %s\n", schema, s.CheckedAt.UTC().Format(time.RFC3339))
	p.f("scheduled: %s\n", scheduledLine(s))
	if !s.NextDue.IsZero() {
		p.f("next due: %s (%s), event %s of topic %s\n", fmtTime(s.NextDue), dueIn(s.NextDue, s.CheckedAt), s.NextEventID, s.NextTopic)
	}
	if s.Overdue > 0 {
		p.f("overdue messages wait for a relay to move them into the outbox: is one running on schema %s, of a version with scheduled messages? (`onceflow status` checks)\n", schema)
	}
	if len(topics) > 0 {
		if sample > 0 && s.Rows > int64(sample) {
			p.f("\nper topic, among the next %d due (--all counts every row):", sample)
		}
		p.f("\nTOPIC\tSCHEDULED\tNEXT DUE\n")
		for _, t := range topics {
			p.f("%s\t%d\t%s\n", t.Topic, t.Rows, fmtTime(t.NextDue))
		}
	}
	return p.flush(tw)
}

// scheduledLine is "8 messages, 2 overdue" with the counts' precision.
func scheduledLine(s relay.ScheduledSummary) string {
	about, more := "", ""
	if !s.Exact {
		about = "about "
	}
	if s.OverdueCapped {
		more = " or more"
	}
	return fmt.Sprintf("%s%s, %d%s overdue (due over %s ago, not yet moved into the outbox)",
		about, plural(int(s.Rows), "message"), s.Overdue, more, relay.ScheduledOverdueAfter)
}

// dueIn says when due is from now (the database's clock): "in 59m59s", "due" (within the
// grace a relay takes to move it), or "overdue 2m0s".
func dueIn(due, now time.Time) string {
	d := due.Sub(now).Round(time.Second)
	switch {
	case d > 0:
		return "in " + d.String()
	case -d <= relay.ScheduledOverdueAfter:
		return "due"
	default:
		return "overdue " + (-d).String()
	}
}
