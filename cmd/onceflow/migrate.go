package main

import (
	"context"
	"fmt"
	"os"
	"text/tabwriter"

	"github.com/onceflow/onceflow/migrations"
)

func runMigrate(ctx context.Context, args []string) error {
	fs := newFlagSet("migrate", "migrate up|status|print [flags]\n\n"+
		"  up      apply pending migrations (safe to run from several processes at once)\n"+
		"  status  list migrations and when each was applied\n"+
		"  print   write the SQL to stdout for goose, golang-migrate or atlas (needs no database)")
	db := addDBFlags(fs)
	if len(args) == 0 {
		fs.Usage()
		return errUsage
	}
	action := args[0]
	if err := parse(fs, args[1:]); err != nil {
		return err
	}
	opts := migrations.Options{Schema: db.schema}
	switch action {
	case "print":
		sql, err := migrations.Print(opts)
		if err != nil {
			return err
		}
		_, err = fmt.Print(sql)
		return err
	case "up", "status":
	case "-h", "--help", "help":
		fs.Usage()
		return nil
	default:
		fmt.Fprintf(os.Stderr, "onceflow migrate: unknown action %q\n", action)
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
			fmt.Printf("schema %q is up to date\n", db.schema)
		}
		for _, m := range applied {
			fmt.Printf("applied %04d_%s to schema %q\n", m.Version, m.Name, db.schema)
		}
		return nil
	}
	statuses, err := migrations.Statuses(ctx, pool, opts)
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "VERSION\tNAME\tAPPLIED AT")
	for _, s := range statuses {
		at := "pending"
		if s.AppliedAt != nil {
			at = s.AppliedAt.UTC().Format("2006-01-02 15:04:05Z")
		}
		fmt.Fprintf(tw, "%04d\t%s\t%s\n", s.Version, s.Name, at)
	}
	return tw.Flush()
}
