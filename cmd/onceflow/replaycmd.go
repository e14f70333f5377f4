package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
)

const poisonReplaySynopsis = `inbox poison replay (--id N[,M...] | --consumer C [--since T] [--error TEXT] | --all) [flags]

Re-drives given-up messages through their own consumer, exactly once, with their original id,
payload and metadata, once the cause is fixed (the fixed handler deployed). The command files
a request (the row's state becomes replay_requested, in one transaction); a running process of
the row's consumer applies it within its replay interval (5 s by default): in one transaction
it removes the message's dedup row, runs the message through its handler, and marks the row
replayed. No other consumer group of the topic sees the message again. A replay that fails
again gives the message up again: the row is back in state poison with its attempts, replay
count and history updated.

Refused: a row whose replay was requested or applied already (a second replay), a message
given up without a dedup key, and a saga's reply or command (resume the saga with
onceflow saga retry). --id is all or nothing: an unknown or refused id requests nothing.
Filters select given-up rows (state poison), oldest first, at most --limit per run, and
combine with AND; nothing matching is an error (exit 1).

Consumers that apply replays: inboxkafka.BatchConsumer with ib.Batch/BatchNoPublish/BatchFunc,
and a Watermill router with ib.Poison (outermost) and router.AddPlugin(ib.RouterPlugin).
onceflow status reports requests that waited long without one.`

func (c *cli) inboxPoisonReplay(ctx context.Context, args []string) error {
	fs := c.newFlagSet("inbox poison replay", poisonReplaySynopsis)
	db := c.addDBFlags(fs)
	idsText := fs.String("id", "", "comma-separated row ids, as listed by onceflow inbox poison")
	consumer := fs.String("consumer", "", "only rows of this inbox consumer (inbox.Config.Consumer)")
	sinceText := fs.String("since", "", "only rows given up since then: a duration back from now (2h) or a time (2025-01-02T15:04:05Z)")
	errText := fs.String("error", "", "only rows whose last error contains this text (case-insensitive)")
	all := fs.Bool("all", false, "every given-up row (needed when no other filter is given)")
	dryRun := fs.Bool("dry-run", false, "print the count and the ids that would be replayed, and change nothing")
	limit := addLimitFlag(fs, maxLimit, "rows to replay per run (oldest first);")
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q (select rows with --id, --consumer, --since, --error or --all)", fs.Args())
	}
	if err := checkLimit(*limit); err != nil {
		return err
	}
	f := inbox.ReplayFilter{Consumer: *consumer, ErrorContains: *errText, All: *all, DryRun: *dryRun, Limit: *limit, By: c.operator()}
	ids, err := parseRowIDs(*idsText)
	if err != nil {
		return fmt.Errorf("%w; nothing requested", err)
	}
	f.IDs = ids
	if *idsText != "" && len(f.IDs) == 0 {
		return errors.New("--id: no row id given; nothing requested")
	}
	if *sinceText != "" {
		since, err := parseSince(*sinceText, time.Now())
		if err != nil {
			return err
		}
		f.Since = since
	}
	if !f.All && len(f.IDs) == 0 && f.Consumer == "" && f.Since.IsZero() && f.ErrorContains == "" {
		fmt.Fprintln(c.stderr, "onceflow inbox poison replay: which rows? pass --id, --consumer, --since or --error, or --all for every given-up row")
		fs.Usage()
		return errUsage
	}
	if len(f.IDs) > 0 && *all {
		return errors.New("--id and --all select differently: pass one of them; nothing requested")
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
	var res inbox.ReplayResult
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		res, err = admin.ReplayTx(ctx, tx, f)
		return err
	})
	p := &printer{w: c.stdout}
	if err != nil {
		return err
	}
	for _, r := range res.Refused {
		fmt.Fprintf(c.stderr, "onceflow inbox poison replay: row %d (consumer %q) refused: %s\n", r.ID, r.Consumer, r.Reason)
	}
	more := ""
	if res.More {
		more = fmt.Sprintf(" (more match: at most --limit %d per run; run it again for the rest)", *limit)
	}
	if *dryRun {
		p.f("%d poison rows would be replayed (dry run: nothing changed)%s; ids: %s\n", len(res.Requested), more, joinIDs(res.Requested))
		return p.err
	}
	p.f("%d poison rows requested for replay%s; ids: %s\n", len(res.Requested), more, joinIDs(res.Requested))
	p.f("a running process of each row's consumer applies them within its replay interval; onceflow inbox poison shows their state\n")
	return p.err
}

func joinIDs(ids []int64) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = strconv.FormatInt(id, 10)
	}
	return strings.Join(s, ", ")
}

// parseSince reads --since: a duration back from now, or an RFC 3339 time.
func parseSince(s string, now time.Time) (time.Time, error) {
	if d, err := time.ParseDuration(s); err == nil {
		if d <= 0 {
			return time.Time{}, fmt.Errorf("--since %s: give a positive duration (e.g. 2h) or a time; nothing requested", s)
		}
		return now.Add(-d), nil
	}
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		return time.Time{}, fmt.Errorf("--since %q is neither a duration (2h) nor an RFC 3339 time (2025-01-02T15:04:05Z); nothing requested", s)
	}
	return t, nil
}

// operator names who runs the command, for the request's record ("cli:alice"): the login
// name from the environment.
func (c *cli) operator() string {
	for _, k := range []string{"USER", "LOGNAME"} {
		if v := strings.TrimSpace(c.getenv(k)); v != "" {
			return "cli:" + v
		}
	}
	return "cli"
}
