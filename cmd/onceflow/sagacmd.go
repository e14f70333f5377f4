package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

const sagaSynopsis = `saga list|show|retry|compensate|versions [flags]

  list        sagas, newest first (--state running|compensating|completed|compensated|stuck, --name N)
  show ID     one saga: state, error, data, every step with its attempts, errors and the commands sent, timers
  retry ID    resume a stuck saga the way it was going: its action (forward) or compensation is re-sent
  compensate ID  stop a running saga and compensate the steps that took effect
  versions    definition versions still alive (sagas not finished) and the orchestrators serving them;
              --require-registered name:version,... exits 4 when a live one is missing from the list

retry and compensate are carried out by a running orchestrator (within its timer interval),
which has the saga's definition; the command only files the request.

  upgrade --name N --from V  move the unfinished sagas of version V, each at a step boundary, onto
              a newer version declaring saga.Upgrade from V (requests an orchestrator carries out)`

func (c *cli) runSaga(ctx context.Context, args []string) error {
	if len(args) == 0 {
		c.sagaUsage(c.stderr)
		return errUsage
	}
	switch args[0] {
	case "upgrade":
		return c.sagaUpgrade(ctx, args[1:]) // sagaupgrade.go
	case "list":
		return c.sagaList(ctx, args[1:])
	case "show":
		return c.sagaShow(ctx, args[1:])
	case "retry", "compensate":
		return c.sagaRequest(ctx, args[0], args[1:])
	case "versions":
		return c.sagaVersions(ctx, args[1:])
	case "-h", "-help", "--help", "help":
		c.sagaUsage(c.stdout) // help asked for: stdout, like every other command's
		return flag.ErrHelp
	default:
		fmt.Fprintf(c.stderr, "onceflow saga: unknown action %q\n\n", args[0])
		c.sagaUsage(c.stderr)
		return errUsage
	}
}

func (c *cli) sagaUsage(w io.Writer) {
	fmt.Fprintf(w, "Usage: onceflow %s\n\nRun 'onceflow saga <action> -h' for the flags of an action.\n", sagaSynopsis)
}

// sagaFilterFlags are the filters of saga list, shared by the bulk retry and compensate.
type sagaFilterFlags struct {
	state, name, step, errText, idPrefix string
	version                              int
	olderThan                            time.Duration
}

func addSagaFilterFlags(fs *flag.FlagSet) *sagaFilterFlags {
	f := &sagaFilterFlags{}
	fs.StringVar(&f.state, "state", "", "only sagas in this state: running, compensating, completed, compensated or stuck")
	fs.StringVar(&f.name, "name", "", "only sagas of this definition")
	fs.IntVar(&f.version, "version", 0, "only sagas of this definition version (0: any)")
	fs.StringVar(&f.step, "step", "", "only sagas whose current step has this name")
	fs.StringVar(&f.errText, "error", "", "only sagas whose error contains this text (ignoring case)")
	fs.StringVar(&f.idPrefix, "id-prefix", "", "only sagas whose id starts with this")
	fs.DurationVar(&f.olderThan, "older-than", 0, "only sagas started longer ago than this (e.g. 2h)")
	return f
}

// filter is the flags as a saga.ListFilter; the Admin validates the rest (saga.ErrBadFilter).
// An unknown --state is a usage error (exit 2), as a mistyped flag is.
func (f *sagaFilterFlags) filter(c *cli, cmd string) (saga.ListFilter, error) {
	switch saga.State(f.state) {
	case "", saga.StateRunning, saga.StateCompensating, saga.StateCompleted, saga.StateCompensated, saga.StateStuck:
	default:
		fmt.Fprintf(c.stderr, "onceflow %s: --state %q is not a saga state; use running, compensating, completed, compensated or stuck\n", cmd, f.state)
		return saga.ListFilter{}, errUsage
	}
	lf := saga.ListFilter{State: saga.State(f.state), Name: f.name, Version: f.version, Step: f.step, Error: f.errText, IDPrefix: f.idPrefix}
	if f.olderThan < 0 {
		return lf, fmt.Errorf("--older-than is %s; it must not be negative", f.olderThan)
	}
	if f.olderThan > 0 {
		lf.StartedBefore = time.Now().Add(-f.olderThan)
	}
	return lf, nil
}

func (c *cli) sagaList(ctx context.Context, args []string) error {
	fs := c.newFlagSet("saga list", "saga list [flags]\n\nLists sagas, newest first, a page at a time (--limit; the next page with the --after it prints).")
	db := c.addDBFlags(fs)
	sf := addSagaFilterFlags(fs)
	limit := addLimitFlag(fs, 100, "sagas")
	after := fs.String("after", "", "list the page after this cursor (printed at the end of the previous page)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := checkLimit(*limit); err != nil {
		return err
	}
	f, err := sf.filter(c, "saga list")
	if err != nil {
		return err
	}
	f.Limit, f.After = *limit, *after
	admin, pool, err := sagaAdmin(ctx, db)
	if err != nil {
		return err
	}
	defer pool.Close()
	page, err := admin.ListPage(ctx, pool, f)
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	p := &printer{w: tw}
	switch {
	case len(page.Sagas) == 0 && page.Searched == 0:
		p.f("no sagas\n")
		return p.flush(tw)
	case len(page.Sagas) == 0:
		p.f("no saga matches yet")
	default:
		p.f("ID\tNAME\tVERSION\tSTATE\tSTEP\tATTEMPT\tSTARTED\tUPDATED\tERROR\n")
	}
	for _, s := range page.Sagas {
		p.f("%s\t%s\t%d\t%s\t%s\t%d\t%s\t%s\t%s\n", s.ID, s.Name, s.Version, s.State, s.Step, s.Attempt,
			fmtTime(s.CreatedAt), fmtTime(s.UpdatedAt), oneLine(s.Error))
	}
	switch {
	case page.Searched > 0:
		p.f("\nsearched %d sagas for the step, error or id filter (no index answers it) and stopped; more may match: add --after %s to search on (--state narrows it)\n",
			page.Searched, page.Next)
	case page.Next != "":
		p.f("\nmore sagas match: add --after %s for the next page\n", page.Next)
	}
	return p.flush(tw)
}

func (c *cli) sagaShow(ctx context.Context, args []string) error {
	fs := c.newFlagSet("saga show", "saga show [flags] ID\n\nShows one saga with its steps, attempts, errors, the commands sent and its timers.")
	db := c.addDBFlags(fs)
	id, err := c.oneID(fs, "show", args)
	if err != nil {
		return err
	}
	admin, pool, err := sagaAdmin(ctx, db)
	if err != nil {
		return err
	}
	defer pool.Close()
	d, err := admin.Get(ctx, pool, id)
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	p := &printer{w: tw}
	p.f("saga %s: %s v%d, %s", d.ID, d.Name, d.Version, d.State)
	if !d.State.Finished() {
		p.f(" at step %s", d.Step)
	}
	p.f("\nstarted %s, updated %s\n", fmtTime(d.CreatedAt), fmtTime(d.UpdatedAt))
	printUpgrades(p, d) // sagaupgrade.go
	if d.Wait != nil {
		p.f("waiting for: %s\n", waitText(d))
	}
	if d.Error != "" {
		p.f("error: %s\n", oneLine(d.Error))
	}
	data, _ := json.Marshal(json.RawMessage(d.Data)) // compact
	p.f("data: %s\n", data)
	p.f("\nSTEP\tSTATUS\tATTEMPTS\tCOMPENSATIONS\tSTARTED\tFINISHED\tLAST ERROR\n")
	for _, s := range d.Steps {
		status := s.Status
		if s.Uncertain {
			status += " (uncertain)"
		}
		if s.SentAs != "" {
			status += " (sent as " + s.SentAs + ")"
		}
		switch {
		case s.Local && s.LocalCompensation:
			status += " (local)"
		case s.Local:
			status += " (local action)"
		case s.LocalCompensation:
			status += " (local compensation)"
		}
		p.f("%s\t%s\t%d\t%d\t%s\t%s\t%s\n", s.Name, status, s.Attempts, s.CompAttempts, fmtTimePtr(s.StartedAt), fmtTimePtr(s.FinishedAt), oneLine(s.LastError))
	}
	// Every command in the order it was written, across steps: an action and, later, its
	// compensation are far apart in time, so per-step lists hid the saga's history.
	type sent struct {
		step string
		cmd  saga.SentCommand
	}
	var cmds []sent
	for _, s := range d.Steps {
		for _, cmd := range s.Sent {
			cmds = append(cmds, sent{s.Name, cmd})
		}
	}
	sort.SliceStable(cmds, func(i, j int) bool { return cmds[i].cmd.At.Before(cmds[j].cmd.At) })
	p.f("\nCOMMANDS SENT (oldest first)\nAT\tSTEP\tPHASE\tATTEMPT\tTOPIC\tEVENT ID\n")
	for _, c := range cmds {
		p.f("%s\t%s\t%s\t%d\t%s\t%s\n", fmtTime(c.cmd.At), c.step, c.cmd.Phase, c.cmd.Attempt, c.cmd.Topic, c.cmd.EventID)
	}
	type received struct {
		step  string
		reply saga.ReceivedReply
	}
	var replies []received
	for _, s := range d.Steps {
		for _, r := range s.Replies {
			replies = append(replies, received{s.Name, r})
		}
	}
	if len(replies) > 0 {
		sort.SliceStable(replies, func(i, j int) bool { return replies[i].reply.At.Before(replies[j].reply.At) })
		p.f("\nREPLIES APPLIED (oldest first)\nAT\tSTEP\tPHASE\tATTEMPT\tOUTCOME\tEVENT ID\tREASON\n")
		for _, r := range replies {
			p.f("%s\t%s\t%s\t%d\t%s\t%s\t%s\n", fmtTime(r.reply.At), r.step, r.reply.Phase, r.reply.Attempt, r.reply.Outcome, r.reply.EventID, oneLine(r.reply.Reason))
		}
	}
	if len(d.Timers) > 0 {
		p.f("\nTIMER\tACTION\tSTEP\tDUE\n")
		for _, t := range d.Timers {
			step := t.Step
			if step == "" {
				step = "-"
			}
			p.f("%s\t%s\t%s\t%s\n", t.Kind, t.Action, step, fmtTime(t.Due))
		}
	}
	return p.flush(tw)
}

// waitText says in one line what a saga waits for, with the command to look further.
func waitText(d *saga.Detail) string {
	w := d.Wait
	cmd := fmt.Sprintf("its %s command of step %s (attempt %d", w.Phase, w.Step, w.Attempt)
	if w.EventID != "" {
		cmd += ", event " + w.EventID
	}
	cmd += ")"
	ago := func(t time.Time) string { return d.CheckedAt.Sub(t).Round(time.Millisecond).String() }
	until := func(t time.Time) string {
		if in := t.Sub(d.CheckedAt).Round(time.Millisecond); in > 0 {
			return "in " + in.String()
		}
		return "due now"
	}
	timeout := ""
	if w.Due != nil {
		timeout = fmt.Sprintf("; the attempt times out at %s (%s)", fmtTime(*w.Due), until(*w.Due))
	}
	switch w.For {
	case saga.WaitRelay:
		s := fmt.Sprintf("a relay: %s is still in the outbox, not yet published, written %s (%s ago)", cmd, fmtTime(w.Since), ago(w.Since))
		if w.PublishAttempts > 0 {
			s += fmt.Sprintf(", %d failed publish attempts, last: %s", w.PublishAttempts, oneLine(w.PublishError))
		}
		return s + fmt.Sprintf("%s; is a relay running? `onceflow status` shows the relays, `onceflow outbox find %s` the row", timeout, w.EventID)
	case saga.WaitParked:
		return fmt.Sprintf("an operator: %s was parked by the relay (%s); `onceflow outbox replay --event-id %s` sends it again",
			cmd, oneLine(w.PublishError), w.EventID)
	case saga.WaitReply:
		return fmt.Sprintf("the reply to %s, published; written %s (%s ago)%s", cmd, fmtTime(w.Since), ago(w.Since), timeout)
	case saga.WaitResend:
		if w.Local {
			s := fmt.Sprintf("a re-run: attempt %d of local step %s (%s) failed and was rolled back (%s); attempt %d runs in an orchestrator's transaction",
				w.Attempt, w.Step, w.Phase, oneLine(w.LastError), w.Attempt+1)
			if w.Due != nil {
				return s + fmt.Sprintf(" at %s (%s)", fmtTime(*w.Due), until(*w.Due))
			}
			return s + " when an orchestrator runs"
		}
		s := fmt.Sprintf("a re-send: attempt %d of step %s failed (%s); attempt %d", w.Attempt, w.Step, oneLine(w.LastError), w.Attempt+1)
		if w.Due != nil {
			return s + fmt.Sprintf(" goes out at %s (%s)", fmtTime(*w.Due), until(*w.Due))
		}
		return s + " goes out when an orchestrator runs"
	case saga.WaitRun:
		s := fmt.Sprintf("its first run: local step %s runs in a transaction of an orchestrator's Run", w.Step)
		if w.Due != nil {
			return s + fmt.Sprintf(", due %s (%s); is an orchestrator running?", fmtTime(*w.Due), until(*w.Due))
		}
		return s
	case saga.WaitVersion:
		replies := fmt.Sprintf("%d replies", w.Parked)
		if w.Parked == 1 {
			replies = "1 reply"
		}
		s := fmt.Sprintf("an orchestrator with definition %s version %d: %s of this saga reached orchestrators without that version registered and wait, parked, since %s (%s ago); "+
			"deploy (or keep running) an orchestrator that registers %s version %d (saga.Register): it applies them in order",
			w.Definition, w.Version, replies, fmtTime(w.Since), ago(w.Since), w.Definition, w.Version)
		if w.LastError != "" {
			s += fmt.Sprintf("; one that has it failed to apply the oldest: %s", oneLine(w.LastError))
		}
		return s
	case saga.WaitOperator:
		s := fmt.Sprintf("an operator: the %s of step %s did not succeed in %s", w.Phase, w.Step, plural(w.Attempt, "attempt"))
		for _, t := range d.Timers {
			if t.Kind == "operator" {
				return s + fmt.Sprintf("; a %s request is filed, due %s: a running orchestrator carries it out", t.Action, fmtTime(t.Due))
			}
		}
		return s + fmt.Sprintf("; fix the cause, then `onceflow saga retry %s` (%s)", d.ID, retryWhat(w))
	}
	return w.For
}

// retryWhat says what `saga retry` does for a stuck saga that waits as w says.
func retryWhat(w *saga.Wait) string {
	if w.Phase == outbox.SagaPhaseCompensation {
		return fmt.Sprintf("re-sends the compensation of step %s as attempt %d: the saga goes on compensating", w.Step, w.Attempt+1)
	}
	return fmt.Sprintf("re-sends the action of step %s as attempt %d: the saga goes on forward; an action that already took effect is answered with its kept result, not run again; "+
		"a saga whose deadline passed while it was stuck compensates instead", w.Step, w.Attempt+1)
}

func (c *cli) sagaRequest(ctx context.Context, action string, args []string) error {
	what := map[string]string{
		"retry":      "Resumes stuck sagas, each the way it was going, with a fresh attempt budget: an orchestrator re-sends the current step's action (stuck moving forward) or its compensation (stuck compensating); `saga show` says which.",
		"compensate": "Stops running sagas: an orchestrator compensates the steps that took effect.",
	}[action]
	fs := c.newFlagSet("saga "+action, "saga "+action+" [flags] ID\n  or: saga "+action+" --state ... [filters] [--dry-run] [--limit N]\n\n"+what+
		"\n\nWith filters (those of saga list) it acts on every saga they select, newest first, at most --limit,\n"+
		"one transaction per saga; each saga the request does not apply to is reported with the reason.\n"+
		"--dry-run prints the count and the ids and files nothing.")
	db := c.addDBFlags(fs)
	sf := addSagaFilterFlags(fs)
	dry := fs.Bool("dry-run", false, "print the sagas the filters select, and file nothing")
	limit := addLimitFlag(fs, 100, "sagas")
	pos, err := c.positional(fs, args)
	if err != nil {
		return err
	}
	if err := checkLimit(*limit); err != nil {
		return err
	}
	filtered := false
	fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "state", "name", "version", "step", "error", "id-prefix", "older-than":
			filtered = true
		}
	})
	switch {
	case len(pos) == 1 && !filtered && !*dry:
	case len(pos) == 0 && filtered:
	default:
		fmt.Fprintf(c.stderr, "onceflow saga %s: give one saga id, or filters (e.g. --state stuck) with optional --dry-run and --limit, not both\n", action)
		return errUsage
	}
	admin, pool, err := sagaAdmin(ctx, db)
	if err != nil {
		return err
	}
	defer pool.Close()
	if len(pos) == 1 {
		id := pos[0]
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if action == "retry" {
				return admin.RetryTx(ctx, tx, id)
			}
			return admin.CompensateTx(ctx, tx, id)
		})
		if err != nil {
			return err
		}
		caveat := ""
		if action == "retry" {
			if d, err := admin.Get(ctx, pool, id); err == nil && d.Wait != nil {
				caveat = " (it " + retryWhat(d.Wait) + ")"
			}
		}
		if action == "compensate" {
			// A saga past its pivot was refused above when its history records the pivot
			// (every saga started since); for an older one the CLI, which has no definitions,
			// cannot tell: say what happens then.
			if d, err := admin.Get(ctx, pool, id); err == nil {
				if _, known := admin.PastPivot(d); !known {
					caveat = "; if the saga is past its pivot, the orchestrator drops the request and the saga goes on"
				}
			}
		}
		_, err = fmt.Fprintf(c.stdout, "%s requested for saga %s; a running orchestrator carries it out%s (watch it with: onceflow saga show %s)\n", action, id, caveat, id)
		return err
	}
	f, err := sf.filter(c, "saga "+action)
	if err != nil {
		return err
	}
	bulk := admin.RetryMatching
	if action == "compensate" {
		bulk = admin.CompensateMatching
	}
	res, err := bulk(ctx, pool, f, saga.BulkOptions{DryRun: *dry, Limit: *limit})
	p := &printer{w: c.stdout}
	more := ""
	if res.More {
		more = fmt.Sprintf(" (more match: at most --limit %d per run; run it again for the rest)", *limit)
	}
	if err != nil && len(res.Requested) == 0 {
		return err
	}
	if len(res.Matched) == 0 {
		return fmt.Errorf("no saga matches the filters: nothing to %s (onceflow saga list with the same filters shows what they select)", action)
	}
	if *dry {
		p.f("%d sagas would get a %s request (dry run: nothing filed)%s:\n", len(res.Matched), action, more)
		for _, id := range res.Matched {
			p.f("  %s\n", id)
		}
		return p.err
	}
	for _, id := range res.Requested {
		p.f("%s requested for saga %s\n", action, id)
	}
	for _, r := range res.Refused {
		p.f("refused saga %s: %s\n", r.ID, r.Reason())
	}
	p.f("%d of %d sagas requested, %d refused%s; a running orchestrator carries the requests out\n", len(res.Requested), len(res.Matched), len(res.Refused), more)
	if p.err != nil {
		return p.err
	}
	if err != nil {
		return fmt.Errorf("stopped after %d requests: %w", len(res.Requested), err)
	}
	if len(res.Refused) > 0 {
		return fmt.Errorf("%d sagas refused (listed above); the others were requested", len(res.Refused))
	}
	return nil
}

// sagaAdmin connects for a saga command.
func sagaAdmin(ctx context.Context, db *dbFlags) (*saga.Admin, *pgxpool.Pool, error) {
	admin, err := saga.NewAdmin(db.schema)
	if err != nil {
		return nil, nil, err
	}
	pool, err := db.connect(ctx, "onceflow-saga")
	return admin, pool, err
}

// oneID parses flags and exactly one positional saga id.
func (c *cli) oneID(fs *flag.FlagSet, action string, args []string) (string, error) {
	pos, err := c.positional(fs, args)
	if err != nil {
		return "", err
	}
	if len(pos) != 1 {
		fmt.Fprintf(c.stderr, "onceflow saga %s: give exactly one saga id (see onceflow saga list)\n", action)
		return "", errUsage
	}
	return pos[0], nil
}

// positional parses the flags, which may come before or after the positional arguments, and
// returns the positional ones.
func (c *cli) positional(fs *flag.FlagSet, args []string) ([]string, error) {
	var flags, pos []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if strings.HasPrefix(a, "-") {
			flags = append(flags, a)
			// A flag's value follows it unless given with "=" or the flag is a boolean.
			name := strings.TrimLeft(a, "-")
			isBool := false
			if f := fs.Lookup(name); f != nil {
				if bf, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && bf.IsBoolFlag() {
					isBool = true
				}
			}
			if !strings.Contains(a, "=") && !isBool && i+1 < len(args) && a != "-h" && a != "--help" {
				flags = append(flags, args[i+1])
				i++
			}
			continue
		}
		pos = append(pos, a)
	}
	if err := parse(fs, flags); err != nil {
		return nil, err
	}
	return append(pos, fs.Args()...), nil
}

// plural is "1 attempt", "2 attempts".
func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

func fmtTimePtr(t *time.Time) string {
	if t == nil {
		return "-"
	}
	return fmtTime(*t)
}
