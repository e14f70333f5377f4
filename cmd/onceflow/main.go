// Command onceflow runs the outbox relay and the maintenance tasks of onceflow:
// schema migrations, outbox inspection and replay, and retention cleanup.
//
// Every subcommand reads its settings from flags, falling back to environment variables
// (DATABASE_URL, ONCEFLOW_SCHEMA, ...); `onceflow <command> -h` lists them with defaults.
// Passwords in connection strings are never printed: not in usage text, errors or logs.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"os/user"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"github.com/onceflow/onceflow/audit"
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
	{"status", "is anything stuck? relays, backlog, parked rows, retention, sagas (exit 4 when stuck)", (*cli).runStatus},
	{"topics", "create the Kafka topics the outbox publishes to, list them (create|list)", (*cli).runTopics},
	{"outbox", "inspect pending rows, find one event, list and replay parked rows, list scheduled ones (inspect|find|parked|replay|scheduled)", (*cli).runOutbox},
	{"cleanup", "delete expired inbox dedup rows, HTTP idempotency records and finished sagas in bounded batches (once, or on a schedule)", (*cli).runCleanup},
	{"inbox", "list the messages consumers gave up on, replay or delete them (poison [replay|delete]); the retry lane (parked [release])", (*cli).runInbox},
	{"saga", "list sagas, show one, resume a stuck one, compensate a running one, the versions still alive (list|show|retry|compensate|versions)", (*cli).runSaga},
	{"ui", "serve the operator console in a browser (read-only unless --actions; a credential unless on loopback)", (*cli).runUI},
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
	stdout  io.Writer           // results: tables, reports, SQL, help asked for
	stderr  io.Writer           // logs, errors, usage after a mistake
	getenv  func(string) string // os.Getenv in main
	secrets *secrets            // connection strings seen, masked in everything written
}

// run executes one command line and returns the exit status: 0 done (or help asked for),
// 1 failed, 2 bad usage; a command may return an *exitError for another status (migrate
// status: 3 = steps pending).
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	// Everything the command writes passes through the mask, logs of the libraries it drives
	// included: a password that reaches an error message or a log line is not printed.
	s := &secrets{}
	s.add(getenv("DATABASE_URL"))
	c := &cli{stdout: &maskingWriter{w: stdout, s: s}, stderr: &maskingWriter{w: stderr, s: s}, getenv: getenv, secrets: s}
	if len(args) == 0 {
		c.usage(c.stderr)
		return 2
	}
	switch args[0] {
	case "-h", "-help", "--help":
		c.usage(c.stdout)
		return 0
	case "help": // help <command> [<action>] is <command> [<action>] -h
		if len(args) == 1 {
			c.usage(c.stdout)
			return 0
		}
		args = append(slices.Clone(args[1:]), "-h")
	case "version", "-version", "--version":
		fmt.Fprintln(c.stdout, "onceflow", version())
		return 0
	}
	for _, cmd := range commands {
		if cmd.name == args[0] {
			// Operator actions (retry, replay, delete, ...) are recorded with who ran them.
			err := cmd.run(c, audit.WithActor(ctx, "cli:"+osUser(getenv)), args[1:])
			var ee *exitError
			switch {
			case err == nil:
				return 0
			case errors.Is(err, flag.ErrHelp):
				return 0
			case errors.Is(err, errUsage):
				return 2
			case errors.As(err, &ee):
				fmt.Fprintf(c.stderr, "onceflow %s: %s\n", cmd.name, withoutPrefix(cmd.name, ee.err))
				return ee.code
			default:
				fmt.Fprintf(c.stderr, "onceflow %s: %s\n", cmd.name, withoutPrefix(cmd.name, err))
				return 1
			}
		}
	}
	fmt.Fprintf(c.stderr, "onceflow: unknown command %q\n\n", args[0])
	c.usage(c.stderr)
	return 2
}

// version is the module version the binary was built from (go install ...@v1.2.3), or
// "(devel)" for a build from a checkout, with the commit when the build recorded one.
func version() string {
	v := "(devel)"
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return v
	}
	if info.Main.Version != "" {
		v = info.Main.Version
	}
	var rev, dirty string
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value[:min(12, len(s.Value))]
		case "vcs.modified":
			if s.Value == "true" {
				dirty = "-dirty"
			}
		}
	}
	if v == "(devel)" && rev != "" {
		v += " " + rev + dirty
	}
	return v + " " + info.GoVersion
}

// withoutPrefix is err's message without a leading "name: ", which the library packages put
// on their errors (saga: ..., relay: ...) and the command's own prefix already says:
// "onceflow saga: no saga with this id", not "onceflow saga: saga: no saga with this id".
func withoutPrefix(name string, err error) string {
	return strings.TrimPrefix(err.Error(), name+": ")
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

func (c *cli) usage(w io.Writer) {
	var b strings.Builder
	b.WriteString("Usage: onceflow <command> [flags]\n\nCommands:\n")
	for _, cmd := range commands {
		fmt.Fprintf(&b, "  %-9s %s\n", cmd.name, cmd.summary)
	}
	b.WriteString("\nRun 'onceflow <command> -h' (or 'onceflow help <command>') for the flags of a command,\n" +
		"'onceflow --version' for the version.\n")
	_, _ = io.WriteString(w, b.String()) // nothing to do about a closed terminal
}

// osUser is the name of the user running the command, for the audit trail: the account's
// name, else $USER, else the numeric uid.
func osUser(getenv func(string) string) string {
	if u, err := user.Current(); err == nil && u.Username != "" {
		return u.Username
	}
	if u := getenv("USER"); u != "" {
		return u
	}
	return "uid " + strconv.Itoa(os.Getuid())
}
