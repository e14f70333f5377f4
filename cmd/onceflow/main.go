// Command onceflow runs the outbox relay and the maintenance tasks of onceflow:
// schema migrations, outbox inspection and replay, and retention cleanup.
//
// Every subcommand reads its settings from flags, falling back to environment variables
// (DATABASE_URL, ONCEFLOW_SCHEMA, ...); `onceflow <command> -h` lists them with defaults.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

type command struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string) error
}

// commands is the whole CLI surface, in the order `onceflow -h` prints it.
var commands = []command{
	{"migrate", "apply, list or print the schema migrations (up|status|print)", runMigrate},
	{"relay", "publish the outbox to Kafka (run one or more)", runRelay},
	{"outbox", "inspect pending rows, list parked rows, replay them (inspect|parked|replay)", runOutbox},
	{"cleanup", "delete expired dedup rows in bounded batches (once, or on a schedule)", runCleanup},
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:]))
}

func run(ctx context.Context, args []string) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage()
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	for _, c := range commands {
		if c.name == args[0] {
			err := c.run(ctx, args[1:])
			switch {
			case err == nil:
				return 0
			case errors.Is(err, flag.ErrHelp):
				return 0
			case errors.Is(err, errUsage):
				return 2
			default:
				fmt.Fprintf(os.Stderr, "onceflow %s: %v\n", c.name, err)
				return 1
			}
		}
	}
	fmt.Fprintf(os.Stderr, "onceflow: unknown command %q\n\n", args[0])
	usage()
	return 2
}

// errUsage marks an error already explained to the user by a flag set's usage output.
var errUsage = errors.New("usage error")

func usage() {
	fmt.Fprintln(os.Stderr, "Usage: onceflow <command> [flags]\n\nCommands:")
	for _, c := range commands {
		fmt.Fprintf(os.Stderr, "  %-9s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(os.Stderr, "\nRun 'onceflow <command> -h' for the flags of a command.")
}
