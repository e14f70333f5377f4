package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
)

const inboxSynopsis = `inbox poison [list|replay|delete] | parked [release] [flags]

  poison         messages a consumer gave up on (inbox_poison), newest first: consumer,
                 message uuid, source, attempts, state, error
  poison replay  re-drive given-up messages through their own consumer, exactly once, once
                 the bug is fixed: --id N[,M...] | --consumer C [--since T] [--error TEXT] | --all
                 [--dry-run] [--limit N]
  poison delete  remove handled rows: --id N[,M...]
  parked         the retry lane (inbox.RetryAfter): messages whose handler asked to try again
                 later, and the later messages of their keys parked behind them, key by key;
                 --count: per consumer, the rows, keys, longest wait and next due
  parked release retry now, once the provider is back: --id N[,M...] (heads) | --consumer C

A message is given up after its attempts (or at once when no retry can fix it) in one
transaction with its dedup row, so its partition moved on and a redelivery is skipped.`

func (c *cli) runInbox(ctx context.Context, args []string) error {
	if len(args) == 0 {
		c.inboxUsage(c.stderr)
		return errUsage
	}
	switch args[0] {
	case "poison":
		rest := args[1:]
		if len(rest) > 0 {
			switch rest[0] {
			case "list":
				return c.inboxPoisonList(ctx, rest[1:])
			case "delete":
				return c.inboxPoisonDelete(ctx, rest[1:])
			case "replay":
				return c.inboxPoisonReplay(ctx, rest[1:])
			}
		}
		return c.inboxPoisonList(ctx, rest)
	case "parked":
		rest := args[1:]
		if len(rest) > 0 && rest[0] == "release" {
			return c.inboxParkedRelease(ctx, rest[1:])
		}
		return c.inboxParked(ctx, rest)
	case "-h", "-help", "--help", "help":
		c.inboxUsage(c.stdout)
		return flag.ErrHelp
	default:
		fmt.Fprintf(c.stderr, "onceflow inbox: unknown action %q\n\n", args[0])
		c.inboxUsage(c.stderr)
		return errUsage
	}
}

func (c *cli) inboxUsage(w io.Writer) {
	fmt.Fprintf(w, "Usage: onceflow %s\n\nRun 'onceflow inbox poison -h', 'onceflow inbox poison replay -h', 'onceflow inbox poison delete -h',\n"+
		"'onceflow inbox parked -h' or 'onceflow inbox parked release -h' for the flags.\n", inboxSynopsis)
}

// poisonRow is one row of inbox_poison; --json prints a list of them.
type poisonRow struct {
	ID          int64     `json:"id"`
	Consumer    string    `json:"consumer"`
	DedupKey    *string   `json:"dedup_key"` // null: the message had no usable key
	MessageUUID string    `json:"message_uuid"`
	Source      string    `json:"source"`
	Attempts    int       `json:"attempts"`
	FailedAt    time.Time `json:"failed_at"`
	Error       string    `json:"error"`
	// State is poison, replay_requested, replayed or duplicate (the replay found the message
	// applied by another delivery; its handler did not run again); Replays counts the replays
	// applied.
	State   string `json:"state"`
	Replays int    `json:"replays"`
	// History lists the row's replay events (requested, replayed, duplicate, failed), oldest first.
	History  []map[string]any  `json:"history"`
	Metadata map[string]string `json:"metadata"`
	// Payload is the message's payload as text when it is valid UTF-8; otherwise
	// PayloadBase64 holds it.
	Payload       *string `json:"payload,omitempty"`
	PayloadBase64 []byte  `json:"payload_base64,omitempty"`
}

// poisonRowOf is r as --json prints it: the payload as text when it is valid UTF-8.
func poisonRowOf(r inbox.PoisonRow) poisonRow {
	out := poisonRow{ID: r.ID, Consumer: r.Consumer, DedupKey: r.DedupKey, MessageUUID: r.MessageUUID, Source: r.Source, Attempts: r.Attempts,
		FailedAt: r.FailedAt, Error: r.Error, State: r.State, Replays: r.Replays, History: r.History, Metadata: r.Metadata}
	switch {
	case r.Payload == nil: // not read: the table does not show it
	case utf8.Valid(r.Payload):
		s := string(r.Payload)
		out.Payload = &s
	default:
		out.PayloadBase64 = r.Payload
	}
	return out
}

// poisonCountCap bounds the count of a listing's total: it stops there ("N or more").
const poisonCountCap = 1_000_000

const poisonListSynopsis = `inbox poison [flags]

Lists the messages a consumer gave up on (a batched consumer, or a router with the inbox's
Poison middleware), newest first, with their state: poison (given up), replay_requested
(waiting for a process of its consumer), replayed, or duplicate (when its replay ran, another
delivery had applied the message: its handler did not run again). Each was recorded together with its
dedup row: its partition moved on, and a redelivery of it is skipped. --json adds the dedup
key, the metadata, the payload and the replay history.

Once the cause is fixed: onceflow inbox poison replay --id N (or --consumer C) re-drives the
messages through their own consumer, exactly once. Remove a row when it is handled:
onceflow inbox poison delete --id N.`

func (c *cli) inboxPoisonList(ctx context.Context, args []string) error {
	fs := c.newFlagSet("inbox poison", poisonListSynopsis)
	db := c.addDBFlags(fs)
	consumer := fs.String("consumer", "", "only rows of this inbox consumer (inbox.Config.Consumer)")
	limit := addLimitFlag(fs, 100, "rows (newest first)")
	before := fs.Int64("before", 0, "list the rows older than this id (the next page of a listing)")
	asJSON := fs.Bool("json", false, "print the rows as a JSON array, with dedup key, metadata and payload")
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q (filter with --consumer)", fs.Args())
	}
	if err := checkLimit(*limit); err != nil {
		return err
	}
	if *before < 0 {
		return fmt.Errorf("--before is %d; pass a row id from a listing", *before)
	}
	admin, err := inbox.NewAdmin(db.schema)
	if err != nil {
		return err
	}
	pool, err := db.connectMigrated(ctx, "onceflow-inbox")
	if err != nil {
		return err
	}
	defer pool.Close()
	total, _, err := admin.CountPoison(ctx, pool, *consumer, "", poisonCountCap)
	if err != nil {
		return err
	}
	f := inbox.PoisonFilter{Consumer: *consumer, Before: *before, Limit: *limit, WithPayload: *asJSON}
	page, err := admin.Poison(ctx, pool, f)
	if err != nil {
		return err
	}
	// A full page has a next one when a row older than its last exists (the total counts the
	// pages before --before too, so it cannot tell).
	more := false
	if len(page) == *limit {
		f.Before, f.Limit, f.WithPayload = page[len(page)-1].ID, 1, false
		next, err := admin.Poison(ctx, pool, f)
		if err != nil {
			return err
		}
		more = len(next) > 0
	}
	list := make([]poisonRow, len(page))
	for i, r := range page {
		list[i] = poisonRowOf(r)
	}
	if *asJSON {
		b, _ := json.Marshal(list)
		_, err := fmt.Fprintf(c.stdout, "%s\n", b)
		return err
	}
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	p := &printer{w: tw}
	if len(list) == 0 {
		if *consumer != "" {
			p.f("no poison messages of consumer %q\n", *consumer)
		} else {
			p.f("no poison messages\n")
		}
		return p.flush(tw)
	}
	p.f("ID\tCONSUMER\tMESSAGE UUID\tSOURCE\tATTEMPTS\tSTATE\tFAILED AT\tERROR\n")
	for _, r := range list {
		p.f("%d\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", r.ID, r.Consumer, r.MessageUUID, r.Source, r.Attempts, r.State, fmtTime(r.FailedAt), shorten(r.Error, 100))
	}
	shown := ""
	switch {
	case more:
		shown = fmt.Sprintf(" (%d shown; --before %d lists the next page)", len(list), list[len(list)-1].ID)
	case int64(len(list)) < total:
		shown = fmt.Sprintf(" (%d shown: the last page)", len(list))
	}
	count := plural(int(total), "poison message")
	if total >= poisonCountCap {
		count = fmt.Sprintf("%d or more poison messages", total)
	}
	p.f("\n%s%s. Each has its dedup row: a redelivery is skipped.\n", count, shown)
	p.f("--json shows the dedup key, metadata, payload and replay history;\n")
	p.f("once the cause is fixed: onceflow inbox poison replay --id %d (or --consumer %s); once handled: onceflow inbox poison delete --id %d\n",
		list[0].ID, list[0].Consumer, list[0].ID)
	return p.flush(tw)
}

func (c *cli) inboxPoisonDelete(ctx context.Context, args []string) error {
	fs := c.newFlagSet("inbox poison delete", "inbox poison delete --id N[,M...] [flags]\n\n"+
		"Removes handled rows of inbox_poison. Their dedup rows stay, so a redelivery of those\n"+
		"messages is still skipped. Every id must exist (and belong to --consumer, if given),\n"+
		"or nothing is deleted.")
	db := c.addDBFlags(fs)
	idsText := fs.String("id", "", "comma-separated row ids, as listed by onceflow inbox poison")
	consumer := fs.String("consumer", "", "refuse unless every row belongs to this consumer")
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q (pass the rows with --id)", fs.Args())
	}
	ids, err := parseRowIDs(*idsText)
	if err != nil {
		return err
	}
	if len(ids) == 0 {
		fmt.Fprintln(c.stderr, "onceflow inbox poison delete: which rows? pass --id N[,M...] (see onceflow inbox poison)")
		fs.Usage()
		return errUsage
	}
	admin, err := inbox.NewAdmin(db.schema)
	if err != nil {
		return err
	}
	pool, err := db.connectMigrated(ctx, "onceflow-inbox")
	if err != nil {
		return err
	}
	defer pool.Close()
	errMissing := errors.New("missing rows")
	var deleted []int64
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		deleted, err = admin.DeletePoisonTx(ctx, tx, inbox.DeleteFilter{IDs: ids, Consumer: *consumer})
		if err != nil {
			return err
		}
		if len(deleted) != len(ids) {
			return errMissing // roll back: bad input changes nothing
		}
		return nil
	})
	if errors.Is(err, errMissing) {
		var missing []string
		for _, id := range ids {
			if !slices.Contains(deleted, id) {
				missing = append(missing, strconv.FormatInt(id, 10))
			}
		}
		of := ""
		if *consumer != "" {
			of = fmt.Sprintf(" of consumer %q", *consumer)
		}
		return fmt.Errorf("no poison row%s with id %s in schema %q; nothing deleted (see onceflow inbox poison)", of, strings.Join(missing, ", "), db.schema)
	}
	if err != nil {
		return err
	}
	slices.Sort(deleted)
	p := &printer{w: c.stdout}
	for _, id := range deleted {
		p.f("deleted poison row %d\n", id)
	}
	p.f("%d poison rows deleted; their dedup rows stay, so a redelivery is still skipped\n", len(deleted))
	return p.err
}

// shorten puts s on one line and cuts it to n bytes (at a rune boundary), marking the cut.
func shorten(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "…"
}

const parkedSynopsis = `inbox parked [flags]

Lists the inbox's retry lane (inbox.RetryAfter): the messages whose handler asked to try
again later, each at the head of its key (its lane: consumer, topic and partition key), and
the later messages of that key, parked behind it so they are never applied ahead of it. Its
partition went on; other keys are applied as usual. A process of the consumer applies a head
when it is due (DUE), exactly once, then the next message of its key at once; after the
consumer's LaneMaxAttempts a head is given up as poison (onceflow inbox poison).

Rows are listed key by key (each head, then the rows behind it; then the messages parked
without a key), a page at a time (--limit; the next page with the --after it prints), or in
the order they were parked (--order id). --count shows, per consumer, the parked messages,
their keys, the longest wait and the next due instead.

Once the provider a head waits for is back: onceflow inbox parked release --id N (a head) or
--consumer C (every head of the consumer) makes them due now.`

// parkedJSON is a page of `inbox parked --json`.
type parkedJSON struct {
	CheckedAt time.Time       `json:"checked_at"`
	Rows      []parkedRowJSON `json:"rows"`
	// Next is the --after of the following page ("" when this page is the last); Searched is
	// set when a filtered --order id page stopped after reading that many rows without
	// filling up.
	Next     string `json:"next,omitempty"`
	Searched int    `json:"searched,omitempty"`
}

type parkedRowJSON struct {
	ID          int64  `json:"id"`
	Consumer    string `json:"consumer"`
	Topic       string `json:"topic"`
	Key         string `json:"key"` // "" when the message has none: it was parked alone
	DedupKey    string `json:"dedup_key"`
	MessageUUID string `json:"message_uuid"`
	Source      string `json:"source"`
	Handler     string `json:"handler,omitempty"`
	// Head is true for the first row of its key, applied when due (DueAt); the others wait
	// behind it (no due time).
	Head     bool       `json:"head"`
	DueAt    *time.Time `json:"due_at"`
	Attempts int        `json:"attempts"`
	Error    string     `json:"error"`
	ParkedAt time.Time  `json:"parked_at"`
}

// parkedCountJSON is `inbox parked --count --json`: one object per consumer.
type parkedCountJSON struct {
	Consumer  string `json:"consumer"`
	Rows      int64  `json:"rows"`
	RowsExact bool   `json:"rows_exact"`
	Keys      int64  `json:"keys"`
	KeysExact bool   `json:"keys_exact"`
	// Oldest* is the head that has waited longest and its key.
	OldestParkedAt   time.Time  `json:"oldest_parked_at"`
	OldestAgeSeconds float64    `json:"oldest_age_seconds"`
	OldestID         int64      `json:"oldest_id"`
	OldestTopic      string     `json:"oldest_topic"`
	OldestKey        string     `json:"oldest_key"`
	NextDue          *time.Time `json:"next_due,omitempty"`
	LagSeconds       float64    `json:"lag_seconds"`
	CheckedAt        time.Time  `json:"checked_at"`
}

func (c *cli) inboxParked(ctx context.Context, args []string) error {
	fs := c.newFlagSet("inbox parked", parkedSynopsis)
	db := c.addDBFlags(fs)
	consumer := fs.String("consumer", "", "only rows of this inbox consumer (inbox.Config.Consumer)")
	topic := fs.String("topic", "", "only rows consumed from this topic (with --consumer)")
	key := fs.String("key", "", "only rows of this key: its partition key (with --consumer and --topic)")
	order := fs.String("order", string(inbox.ParkedByLane), "lane: key by key, each head then the rows behind it; id: in the order they were parked")
	limit := addLimitFlag(fs, 100, "rows")
	after := fs.String("after", "", "list the page after this cursor (printed at the end of the previous page)")
	count := fs.Bool("count", false, "show per consumer the parked messages, their keys, the longest wait and the next due, not the rows")
	asJSON := fs.Bool("json", false, "print the page (or with --count the figures) as JSON")
	if err := parse(fs, args); err != nil {
		return err
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var problems []error
	if fs.NArg() > 0 {
		problems = append(problems, fmt.Errorf("unexpected arguments %q (filter with --consumer, --topic and --key)", fs.Args()))
	}
	if *count && (set["consumer"] || set["topic"] || set["key"] || set["order"] || set["after"] || set["limit"]) {
		problems = append(problems, errors.New("--count counts every consumer's lane: --consumer, --topic, --key, --order, --after and --limit are for the listing"))
	}
	if *topic != "" && *consumer == "" {
		problems = append(problems, errors.New("--topic needs --consumer: a lane is one consumer's"))
	}
	if *key != "" && (*consumer == "" || *topic == "") {
		problems = append(problems, errors.New("--key needs --consumer and --topic: a key's lane is one consumer's and one topic's (the listing shows both)"))
	}
	if o := inbox.ParkedOrder(*order); o != inbox.ParkedByLane && o != inbox.ParkedByID {
		problems = append(problems, fmt.Errorf("--order is %q; use lane or id", *order))
	}
	if err := checkLimit(*limit); err != nil {
		problems = append(problems, err)
	}
	if err := errors.Join(problems...); err != nil {
		return err
	}
	admin, err := inbox.NewAdmin(db.schema)
	if err != nil {
		return err
	}
	pool, err := db.connectMigrated(ctx, "onceflow-inbox")
	if err != nil {
		return err
	}
	defer pool.Close()
	sum, err := admin.ParkedSummary(ctx, pool)
	if err != nil {
		return err
	}
	if *count {
		return c.printParkedCount(db.schema, sum, *asJSON)
	}
	page, err := admin.Parked(ctx, pool, inbox.ParkedFilter{Consumer: *consumer, Topic: *topic, Lane: *key, Order: inbox.ParkedOrder(*order), After: *after, Limit: *limit})
	if errors.Is(err, inbox.ErrBadParkedCursor) {
		return fmt.Errorf("--after %q is not a cursor a listing in --order %s printed: pass the one at the end of the previous page", *after, *order)
	}
	if err != nil {
		return err
	}
	if *asJSON {
		out := parkedJSON{CheckedAt: page.CheckedAt, Rows: []parkedRowJSON{}, Next: page.Next, Searched: page.Searched}
		for _, r := range page.Rows {
			out.Rows = append(out.Rows, parkedRowJSON{ID: r.ID, Consumer: r.Consumer, Topic: r.Topic, Key: r.Lane, DedupKey: r.DedupKey,
				MessageUUID: r.MessageUUID, Source: r.Source, Handler: r.Handler, Head: r.Head, DueAt: r.DueAt, Attempts: r.Attempts,
				Error: r.Error, ParkedAt: r.ParkedAt})
		}
		b, _ := json.Marshal(out)
		_, err := fmt.Fprintf(c.stdout, "%s\n", b)
		return err
	}
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	p := &printer{w: tw}
	if len(sum) == 0 {
		p.f("no messages parked in a retry lane\n")
		return p.flush(tw)
	}
	for _, s := range sum {
		if *consumer == "" || s.Consumer == *consumer {
			p.f("consumer %s: %s\n", s.Consumer, parkedLine(s))
		}
	}
	if len(page.Rows) == 0 && page.Searched == 0 {
		p.f("no parked rows match\n")
	}
	if len(page.Rows) > 0 {
		p.f("\nID\tCONSUMER\tTOPIC\tKEY\tPLACE\tDUE\tATTEMPTS\tPARKED\tSOURCE\tMESSAGE UUID\tERROR\n")
		for _, r := range page.Rows {
			key, place := r.Lane, "behind"
			if key == "" {
				key = "-"
			}
			if r.Head {
				place = "head"
			}
			p.f("%d\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\n", r.ID, r.Consumer, r.Topic, key, place, laneDue(r.DueAt, page.CheckedAt),
				r.Attempts, fmtTime(r.ParkedAt), r.Source, r.MessageUUID, shorten(r.Error, 100))
		}
	}
	switch {
	case page.Searched > 0:
		p.f("\nsearched the next %d parked rows in id order for consumer %q and stopped (no index orders a consumer's rows by id; --order lane does); more may match: add --after %s to search on\n",
			page.Searched, *consumer, page.Next)
	case page.Next != "":
		p.f("\nmore parked rows follow: add --after %s for the next page\n", page.Next)
	}
	p.f("\nA head is applied when due, then the rows behind it, in order. Once its provider is back: onceflow inbox parked release --id N (a head) or --consumer C\n")
	return p.flush(tw)
}

// printParkedCount prints --count: the figures of each consumer's lane.
func (c *cli) printParkedCount(schema string, sum []inbox.ConsumerParked, asJSON bool) error {
	if asJSON {
		out := []parkedCountJSON{}
		for _, s := range sum {
			j := parkedCountJSON{Consumer: s.Consumer, Rows: s.Rows, RowsExact: s.RowsExact, Keys: s.Keys, KeysExact: s.KeysExact,
				OldestParkedAt: s.Oldest, OldestAgeSeconds: s.OldestAge().Seconds(), OldestID: s.OldestID, OldestTopic: s.OldestTopic,
				OldestKey: s.OldestLane, LagSeconds: s.Lag().Seconds(), CheckedAt: s.CheckedAt}
			if !s.NextDue.IsZero() {
				j.NextDue = &s.NextDue
			}
			out = append(out, j)
		}
		b, _ := json.Marshal(out)
		_, err := fmt.Fprintf(c.stdout, "%s\n", b)
		return err
	}
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	p := &printer{w: tw}
	if len(sum) == 0 {
		p.f("schema %q: no messages parked in a retry lane\n", schema)
		return p.flush(tw)
	}
	p.f("schema %q at %s\n\nCONSUMER\tPARKED\tKEYS\tLONGEST WAIT\tKEY\tROW\tNEXT DUE\n", schema, sum[0].CheckedAt.UTC().Format(time.RFC3339))
	for _, s := range sum {
		key := s.OldestLane
		if key == "" {
			key = "-"
		}
		next := "-"
		if !s.NextDue.IsZero() {
			next = laneDue(&s.NextDue, s.CheckedAt)
		}
		p.f("%s\t%s\t%s\t%s\t%s %s\t%d\t%s\n", s.Consumer, capped(s.Rows, s.RowsExact), capped(s.Keys, s.KeysExact), s.OldestAge().Round(time.Second),
			s.OldestTopic, key, s.OldestID, next)
	}
	p.f("\ncounts stop at %d; the longest wait is its key's head's (its later messages wait behind it)\n", inbox.ParkedCountCap)
	return p.flush(tw)
}

// parkedLine is one consumer's figures: "3 messages, 2 keys, longest wait 1h0m0s (key o-1 of
// topic orders), next due in 4m0s".
func parkedLine(s inbox.ConsumerParked) string {
	key := fmt.Sprintf("key %s of topic %s", s.OldestLane, s.OldestTopic)
	if s.OldestLane == "" {
		key = fmt.Sprintf("row %d of topic %s, without a key", s.OldestID, s.OldestTopic)
	}
	next := "-"
	if !s.NextDue.IsZero() {
		next = laneDue(&s.NextDue, s.CheckedAt)
	}
	return fmt.Sprintf("%s, %s, longest wait %s (%s), next due %s", countOf(s.Rows, s.RowsExact, "message"), countOf(s.Keys, s.KeysExact, "key"),
		s.OldestAge().Round(time.Second), key, next)
}

// countOf is "1 message", "2 messages" or, for a count that stopped one past its cap, "more
// than 10000 messages".
func countOf(n int64, exact bool, what string) string {
	if !exact {
		return fmt.Sprintf("more than %d %ss", n-1, what)
	}
	return plural(int(n), what)
}

// capped is a count that stopped one past its cap: "more than 10000".
func capped(n int64, exact bool) string {
	if !exact {
		return fmt.Sprintf("more than %d", n-1)
	}
	return strconv.FormatInt(n, 10)
}

// laneDueGrace is how long past its due time a head shows as just "due": a process of its
// consumer looks for due heads every second (Config.LaneInterval) and runs the handler.
const laneDueGrace = 5 * time.Second

// laneDue says when a parked row is due from now (the database's clock): "in 9m59s", "now",
// "overdue 2m0s" (no process applied it yet), or "-" (no due time: it waits behind its head).
func laneDue(due *time.Time, now time.Time) string {
	if due == nil || due.IsZero() {
		return "-"
	}
	d := due.Sub(now).Round(time.Second)
	switch {
	case d > 0:
		return "in " + d.String()
	case -d <= laneDueGrace:
		return "now"
	default:
		return "overdue " + (-d).String()
	}
}

const parkedReleaseSynopsis = `inbox parked release --id N[,M...] | --consumer C [flags]

Retry now: makes heads of the retry lane due at once, once the provider they wait for is
back. A running process of their consumer applies each within its lane interval (1s by
default), exactly once, then the messages of its key parked behind it, in order. Attempts stay
counted: a head that asks for later again is parked again (and given up after the consumer's
LaneMaxAttempts). Recorded in the audit trail.

--id names heads (onceflow inbox parked lists them): a row behind its head is refused (release
the head), and nothing is released unless every id is a parked row (of --consumer, if given).
--consumer alone releases every head of the consumer not yet due, the soonest first, at most
--limit.`

func (c *cli) inboxParkedRelease(ctx context.Context, args []string) error {
	fs := c.newFlagSet("inbox parked release", parkedReleaseSynopsis)
	db := c.addDBFlags(fs)
	idsText := fs.String("id", "", "comma-separated ids of heads, as listed by onceflow inbox parked")
	consumer := fs.String("consumer", "", "with --id: refuse unless every row belongs to this consumer; alone: release every head of this consumer")
	limit := fs.Int("limit", inbox.MaxReleaseLimit, fmt.Sprintf("with --consumer alone: the most heads to release, 1 to %d", inbox.MaxReleaseLimit))
	if err := parse(fs, args); err != nil {
		return err
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var problems []error
	if fs.NArg() > 0 {
		problems = append(problems, fmt.Errorf("unexpected arguments %q (pass the rows with --id, or --consumer)", fs.Args()))
	}
	ids, err := parseRowIDs(*idsText)
	if err != nil {
		problems = append(problems, err)
	}
	if set["limit"] && len(ids) > 0 {
		problems = append(problems, errors.New("--limit bounds a release by --consumer; with --id every named row is released"))
	}
	if *limit < 1 || *limit > inbox.MaxReleaseLimit {
		problems = append(problems, fmt.Errorf("--limit is %d; it must be between 1 and %d", *limit, inbox.MaxReleaseLimit))
	}
	if err := errors.Join(problems...); err != nil {
		return err
	}
	if len(ids) == 0 && *consumer == "" {
		fmt.Fprintln(c.stderr, "onceflow inbox parked release: which heads? pass --id N[,M...] or --consumer C (see onceflow inbox parked)")
		fs.Usage()
		return errUsage
	}
	admin, err := inbox.NewAdmin(db.schema)
	if err != nil {
		return err
	}
	pool, err := db.connectMigrated(ctx, "onceflow-inbox")
	if err != nil {
		return err
	}
	defer pool.Close()
	f := inbox.ReleaseFilter{IDs: ids, Consumer: *consumer}
	if len(ids) == 0 {
		f.Limit = *limit
	}
	var released []int64
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		released, err = admin.ReleaseTx(ctx, tx, f)
		return err
	})
	if err != nil {
		return err
	}
	p := &printer{w: c.stdout}
	for _, id := range released {
		p.f("released parked row %d: due now\n", id)
	}
	switch {
	case len(released) == 0 && len(ids) > 0:
		p.f("nothing released: the heads named are due already; a running process of their consumer applies them (onceflow status shows how late)\n")
	case len(released) == 0:
		p.f("nothing released: consumer %q has no head waiting for a later time (onceflow inbox parked --consumer %s)\n", *consumer, *consumer)
	default:
		more := ""
		if len(ids) == 0 && len(released) == f.Limit {
			more = " (the --limit: more may wait; run it again)"
		}
		p.f("%s made due now%s; a running process of the consumer applies them within its lane interval (1s by default), each key's parked messages after its head\n",
			plural(len(released), "head"), more)
	}
	return p.err
}
