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

const inboxSynopsis = `inbox poison [list|replay|delete] [flags]

  poison         messages a consumer gave up on (inbox_poison), newest first: consumer,
                 message uuid, source, attempts, state, error
  poison replay  re-drive given-up messages through their own consumer, exactly once, once
                 the bug is fixed: --id N[,M...] | --consumer C [--since T] [--error TEXT] | --all
                 [--dry-run] [--limit N]
  poison delete  remove handled rows: --id N[,M...]

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
	fmt.Fprintf(w, "Usage: onceflow %s\n\nRun 'onceflow inbox poison -h', 'onceflow inbox poison replay -h' or 'onceflow inbox poison delete -h' for the flags.\n", inboxSynopsis)
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
	var ids []int64
	var bad []string
	for _, s := range splitList(*idsText) {
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
		return fmt.Errorf("--id: not row ids: %s", strings.Join(bad, ", "))
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
