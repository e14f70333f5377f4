package main

import (
	"context"
	"fmt"
	"strings"

	"github.com/onceflow/onceflow/saga"
)

const sagaUpgradeSynopsis = `saga upgrade --name NAME --from VERSION [--to VERSION] [--dry-run] [--limit N]

Moves the unfinished sagas of one definition version onto a newer version that declares
saga.Upgrade from it (its data converted, its steps mapped), each at a step boundary: running,
with no command in flight (waiting to re-send the current step's command, or to run a local
first step). The CLI has no definitions, so it files an upgrade request per saga at a boundary,
oldest first, at most --limit, one transaction each; an orchestrator that has the new version
registered carries each out within its timer interval (an orchestrator without it leaves the
request to another). Sagas not at a boundary — waiting for a reply, compensating, stuck — are
listed with the reason and get no request; run the command again later for them.

--dry-run lists which sagas are at a boundary and files nothing. The step mapping and the data
conversion need the definitions: the orchestrator checks them, and a refusal is recorded in the
saga with its reason (onceflow saga show ID); in the service, saga.Admin.UpgradeMatching with
DryRun shows them per saga beforehand.`

func (c *cli) sagaUpgrade(ctx context.Context, args []string) error {
	fs := c.newFlagSet("saga upgrade", sagaUpgradeSynopsis)
	db := c.addDBFlags(fs)
	name := fs.String("name", "", "the definition whose sagas to upgrade (required)")
	from := fs.Int("from", 0, "the version those sagas run (required)")
	to := fs.Int("to", 0, "the version to upgrade to (0: the newest one the orchestrator has that declares saga.Upgrade from --from)")
	dry := fs.Bool("dry-run", false, "list the sagas at a step boundary and the others with the reason, and file nothing")
	limit := fs.Int("limit", 100, fmt.Sprintf("sagas to act on (or list), oldest first, 1 to %d", maxLimit))
	pos, err := c.positional(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 || *name == "" || *from < 1 || (*to != 0 && *to <= *from) {
		fmt.Fprintf(c.stderr, "onceflow saga upgrade: give --name and --from (the version the sagas run), and --to only for a later version; no saga ids\n")
		return errUsage
	}
	if err := checkLimit(*limit); err != nil {
		return err
	}
	admin, pool, err := sagaAdmin(ctx, db)
	if err != nil {
		return err
	}
	defer pool.Close()
	res, err := admin.RequestUpgradeMatching(ctx, pool, *name, *from, *to, saga.BulkOptions{DryRun: *dry, Limit: *limit})
	if err != nil && len(res.Requested) == 0 {
		return err
	}
	if len(res.Matched) == 0 {
		return fmt.Errorf("no unfinished saga of %s version %d: nothing to upgrade (onceflow saga list --name %s shows its sagas)", *name, *from, *name)
	}
	target := "the newest version that declares saga.Upgrade from " + fmt.Sprint(*from)
	if *to != 0 {
		target = fmt.Sprintf("version %d (declaring saga.Upgrade from %d)", *to, *from)
	}
	more := ""
	if res.More {
		more = fmt.Sprintf(" (more are unfinished: at most --limit %d per run; run it again for the rest)", *limit)
	}
	p := &printer{w: c.stdout}
	if len(res.Requested) > 0 {
		if served, verr := newerServed(ctx, admin, pool, *name, *from, *to); verr == nil && !served {
			p.f("note: no running orchestrator has %s of %s registered (onceflow saga versions): the requests wait until one runs\n", target, *name)
		}
	}
	if *dry {
		p.f("%d of %d unfinished sagas of %s version %d are at a step boundary and would get an upgrade request to %s (dry run: nothing filed)%s:\n",
			len(res.Requested), len(res.Matched), *name, *from, target, more)
		for _, u := range res.Requested {
			p.f("  %s at step %s\n", u.ID, u.Step)
		}
		if len(res.Refused) > 0 {
			p.f("not upgradable now (no request would be filed):\n")
			for _, r := range res.Refused {
				p.f("  %s: %s\n", r.ID, r.Reason())
			}
		}
		p.f("The orchestrator checks the step mapping and the data conversion when it carries a request out; saga.Admin.UpgradeMatching with DryRun shows them in the service.\n")
		return p.err
	}
	for _, u := range res.Requested {
		p.f("upgrade requested for saga %s (at step %s)\n", u.ID, u.Step)
	}
	for _, r := range res.Refused {
		p.f("refused saga %s: %s\n", r.ID, r.Reason())
	}
	p.f("%d of %d sagas requested, %d refused%s; an orchestrator that has %s of %s carries the requests out: `onceflow saga show ID` shows each upgrade, or why it was refused\n",
		len(res.Requested), len(res.Matched), len(res.Refused), more, target, *name)
	if p.err != nil {
		return p.err
	}
	if err != nil {
		return fmt.Errorf("stopped after %d requests: %w", len(res.Requested), err)
	}
	if len(res.Refused) > 0 {
		return fmt.Errorf("%d sagas refused (listed above); the others were requested; run it again later for those not at a step boundary", len(res.Refused))
	}
	return nil
}

// newerServed reports whether a live orchestrator has a version of name that an upgrade from
// version from (to version to, or the newest when 0) could go to.
func newerServed(ctx context.Context, admin *saga.Admin, db saga.DB, name string, from, to int) (bool, error) {
	vs, err := admin.Versions(ctx, db)
	if err != nil {
		return false, err
	}
	for _, v := range vs {
		if v.Name == name && len(v.Orchestrators) > 0 && (v.Version == to || (to == 0 && v.Version > from)) {
			return true, nil
		}
	}
	return false, nil
}

// printUpgrades prints a saga's upgrades and refused upgrades, one line each, for saga show.
func printUpgrades(p *printer, d *saga.Detail) {
	for _, u := range d.Upgrades() {
		to := fmt.Sprintf("version %d", u.To)
		if u.To == 0 {
			to = "the newest version"
		}
		if u.Refused != "" {
			p.f("upgrade from version %d to %s refused at %s (at step %s): %s\n", u.From, to, fmtTime(u.At), u.Step, oneLine(u.Refused))
			continue
		}
		p.f("upgraded from version %d to %d at %s, step %s → %s\n", u.From, u.To, fmtTime(u.At), u.Step, u.NewStep)
		moves := make([]string, len(u.Moves))
		for i, m := range u.Moves {
			moves[i] = m.String()
		}
		p.f("  steps: %s\n", strings.Join(moves, "; "))
	}
}
