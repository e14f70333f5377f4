package main

import (
	"context"
	"errors"
	"fmt"
	"text/tabwriter"

	"github.com/onceflow/onceflow/migrations"
)

// exitPending is the status of `migrate status` when steps are pending, so a deploy script
// can tell "run migrate up" (3) from "could not check" (1).
const exitPending = 3

func (c *cli) runMigrate(ctx context.Context, args []string) error {
	if len(args) > 0 && args[0] == "from-forwarder" {
		return c.runFromForwarder(ctx, args[1:])
	}
	fs := c.newFlagSet("migrate", "migrate up|status|print [flags]\n\n"+
		"  up      apply pending migrations (safe to run from several processes at once)\n"+
		"  status  list migrations and when each was applied; exit status 0 when every step\n"+
		"          is applied, 3 when steps are pending (run migrate up), 1 when it could not\n"+
		"          check (e.g. no connection), 2 on bad usage\n"+
		"  print   write the SQL to stdout for goose, golang-migrate or atlas (needs no database)\n"+
		"  from-forwarder  move the pending messages of a Watermill forwarder's table into the\n"+
		"          outbox (onceflow migrate from-forwarder -h)")
	db := c.addDBFlags(fs)
	if len(args) == 0 {
		fs.Usage()
		return errUsage
	}
	action := args[0]
	if err := parse(fs, args[1:]); err != nil {
		return err
	}
	// Warnings only: steps in the schema that this binary does not know (a newer release
	// applied them). Results go to stdout as plain lines.
	opts := db.migrationOptions()
	switch action {
	case "print":
		sql, err := migrations.Print(opts)
		if err != nil {
			return err
		}
		_, err = fmt.Fprint(c.stdout, sql)
		return err
	case "up", "status":
	case "-h", "-help", "--help", "help":
		return printHelp(fs)
	default:
		fmt.Fprintf(c.stderr, "onceflow migrate: unknown action %q\n", action)
		fs.Usage()
		return errUsage
	}
	pool, err := db.connect(ctx, "onceflow-migrate")
	if err != nil {
		return err
	}
	defer pool.Close()
	if action == "up" {
		applied, err := migrations.Up(ctx, pool, opts)
		if err != nil {
			return err
		}
		if len(applied) == 0 {
			fmt.Fprintf(c.stdout, "schema %q is up to date\n", db.schema)
		}
		for _, m := range applied {
			fmt.Fprintf(c.stdout, "applied %04d_%s to schema %q\n", m.Version, m.Name, db.schema)
		}
		return nil
	}
	statuses, err := migrations.Statuses(ctx, pool, opts)
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "VERSION\tNAME\tAPPLIED AT")
	for _, s := range statuses {
		at := "pending"
		if s.AppliedAt != nil {
			at = s.AppliedAt.UTC().Format("2006-01-02 15:04:05Z")
		}
		if s.Unknown {
			at += " (unknown to this binary: applied by a newer onceflow)"
		}
		fmt.Fprintf(tw, "%04d\t%s\t%s\n", s.Version, s.Name, at)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	// The exit status comes from Validate, the check services run at start-up, so a deploy
	// script and the service agree on what "migrated" means.
	if err := migrations.Validate(ctx, pool, opts); err != nil {
		if errors.Is(err, migrations.ErrNotMigrated) {
			return &exitError{code: exitPending, err: err}
		}
		return err
	}
	return nil
}
