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
	"io"
	"os"
	"os/signal"
	"syscall"
)

type command struct {
	name    string
	summary string
	run     func(c *cli, ctx context.Context, args []string) error
}

// commands is the whole CLI surface, in the order `onceflow -h` prints it.
var commands = []command{
	{"migrate", "apply, list or print the schema migrations (up|status|print)", (*cli).runMigrate},
	{"relay", "publish the outbox to Kafka (run one or more)", (*cli).runRelay},
	{"outbox", "inspect pending rows, list parked rows, replay them (inspect|parked|replay)", (*cli).runOutbox},
	{"cleanup", "delete expired dedup rows in bounded batches (once, or on a schedule)", (*cli).runCleanup},
	{"saga", "list sagas, show one, resume a stuck one, compensate a running one (list|show|retry|compensate)", (*cli).runSaga},
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// cli is one invocation's surroundings: where it writes and where it reads its environment
// variables. Commands touch no process-wide state besides the network and the database, so
// tests run many invocations at once, each with its own buffers and environment.
type cli struct {
	stdout io.Writer           // results: tables, reports, SQL
	stderr io.Writer           // logs, errors, usage
	getenv func(string) string // os.Getenv in main
}

// run executes one command line and returns the exit status: 0 done, 1 failed, 2 bad usage;
// a command may return an *exitError for another status (migrate status: 3 = steps pending).
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	c := &cli{stdout: stdout, stderr: stderr, getenv: getenv}
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		c.usage()
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	for _, cmd := range commands {
		if cmd.name == args[0] {
			err := cmd.run(c, ctx, args[1:])
			var ee *exitError
			switch {
			case err == nil:
				return 0
			case errors.Is(err, flag.ErrHelp):
				return 0
			case errors.Is(err, errUsage):
				return 2
			case errors.As(err, &ee):
				fmt.Fprintf(c.stderr, "onceflow %s: %v\n", cmd.name, ee.err)
				return ee.code
			default:
				fmt.Fprintf(c.stderr, "onceflow %s: %v\n", cmd.name, err)
				return 1
			}
		}
	}
	fmt.Fprintf(c.stderr, "onceflow: unknown command %q\n\n", args[0])
	c.usage()
	return 2
}

// errUsage marks an error already explained to the user by a flag set's usage output.
var errUsage = errors.New("usage error")

// exitError is a failure with its own exit status, for outcomes a script tells apart.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

func (c *cli) usage() {
	fmt.Fprintln(c.stderr, "Usage: onceflow <command> [flags]\n\nCommands:")
	for _, cmd := range commands {
		fmt.Fprintf(c.stderr, "  %-9s %s\n", cmd.name, cmd.summary)
	}
	fmt.Fprintln(c.stderr, "\nRun 'onceflow <command> -h' for the flags of a command.")
}
