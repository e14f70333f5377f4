package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/migrations"
)

// flagsHeading introduces every command's flags. Not every flag has an environment variable:
// those that do name it in brackets at the end of their line.
const flagsHeading = "Flags (a flag's environment variable, if it has one, in brackets):"

// newFlagSet returns a flag set that reports errors instead of exiting, with a usage text
// that starts with the command's synopsis. Its output is routed by parse: help asked for
// (-h, --help) goes to stdout, usage after a mistake to stderr.
func (c *cli) newFlagSet(name, synopsis string) *flag.FlagSet {
	fs := flag.NewFlagSet("onceflow "+name, flag.ContinueOnError)
	fs.SetOutput(&usageOutput{stdout: c.stdout, stderr: c.stderr})
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: onceflow %s\n\n%s\n", synopsis, flagsHeading)
		fs.PrintDefaults()
	}
	return fs
}

// usageOutput is a flag set's output. While parse runs it holds what the flag package writes
// until the outcome says where it belongs; otherwise (fs.Usage() called after a mistake the
// command found itself) it writes to stderr.
type usageOutput struct {
	stdout, stderr io.Writer
	held           *bytes.Buffer
}

func (u *usageOutput) Write(p []byte) (int, error) {
	if u.held != nil {
		return u.held.Write(p)
	}
	return u.stderr.Write(p)
}

// parse parses args and maps flag errors to errUsage (the flag package already printed why).
// Help asked for is printed on stdout and returned as flag.ErrHelp (exit 0).
func parse(fs *flag.FlagSet, args []string) error {
	u, _ := fs.Output().(*usageOutput)
	if u != nil {
		u.held = &bytes.Buffer{}
	}
	err := fs.Parse(args)
	if u != nil {
		held := u.held
		u.held = nil
		w := u.stderr
		if errors.Is(err, flag.ErrHelp) {
			w = u.stdout
		}
		_, _ = w.Write(held.Bytes())
	}
	switch {
	case err == nil:
		return nil
	case errors.Is(err, flag.ErrHelp):
		return err
	default:
		return errUsage
	}
}

// printHelp prints the flag set's usage as help asked for: on stdout.
func printHelp(fs *flag.FlagSet) error {
	u, _ := fs.Output().(*usageOutput)
	if u != nil {
		u.held = &bytes.Buffer{}
		fs.Usage()
		_, _ = u.stdout.Write(u.held.Bytes())
		u.held = nil
		return flag.ErrHelp
	}
	fs.Usage()
	return flag.ErrHelp
}

// envOr returns the environment variable's value, or def when it is unset or empty.
func (c *cli) envOr(name, def string) string {
	if v := c.getenv(name); v != "" {
		return v
	}
	return def
}

// dbFlags are the connection flags every database command shares.
type dbFlags struct {
	c      *cli
	url    string
	schema string
}

func (c *cli) addDBFlags(fs *flag.FlagSet) *dbFlags {
	d := &dbFlags{c: c, url: c.getenv("DATABASE_URL")}
	fs.Var(&dsnValue{s: &d.url, secrets: c.secrets, warn: c.stderr, flag: "--database-url", env: "DATABASE_URL"}, "database-url",
		"PostgreSQL connection `string` (URL or key=value; its password is never shown) [DATABASE_URL]")
	fs.StringVar(&d.schema, "schema", c.envOr("ONCEFLOW_SCHEMA", pgsql.DefaultSchema), "schema holding the onceflow tables [ONCEFLOW_SCHEMA]")
	return d
}

// dsnValue is the --database-url flag. Its String, which the flag package prints as the
// default in usage text, masks the password; Set remembers the value as a secret, so it is
// masked in everything the command writes.
type dsnValue struct {
	s       *string
	secrets *secrets
	warn    io.Writer // where a password in the flag is warned about
	flag    string    // the flag's name and its variable, for the warning
	env     string
}

func (v *dsnValue) String() string {
	if v == nil || v.s == nil {
		return ""
	}
	return pgsql.RedactDSN(*v.s)
}

func (v *dsnValue) Set(s string) error {
	*v.s = s
	v.secrets.add(s)
	// A flag's value is in the process's command line, which every user of the host reads
	// (ps, /proc/PID/cmdline) for as long as the process runs: relay, status --watch,
	// cleanup --every and ui run for days.
	if v.warn != nil && pgsql.RedactDSN(s) != s {
		fmt.Fprintln(v.warn, "onceflow: warning: "+v.flag+" carries a password, which ps shows to every user of this host "+
			"while the command runs; pass the URL without it and set PGPASSWORD or ~/.pgpass, or put the whole URL in "+v.env)
	}
	return nil
}

func (d *dbFlags) validate() error {
	var problems []string
	if d.url == "" {
		problems = append(problems, "no database: set DATABASE_URL or pass --database-url postgres://user@host:5432/db")
	}
	if err := pgsql.ValidateSchema(d.schema); err != nil {
		problems = append(problems, err.Error())
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

// connect opens a pool and checks it with a ping. The connections carry application_name
// (unless the URL sets one) so pg_stat_activity shows which onceflow command holds them.
// Its errors never show the password, whatever pgx or the server put in them.
func (d *dbFlags) connect(ctx context.Context, applicationName string) (*pgxpool.Pool, error) {
	pool, err := d.open(ctx, applicationName)
	if err != nil {
		return nil, err
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, pgsql.RedactError(fmt.Errorf("connect to database: %w", err), d.url)
	}
	return pool, nil
}

// open is connect without the ping: the pool connects on first use. The relay uses it, so a
// relay started while PostgreSQL is down waits for it (relay.Run) instead of exiting.
func (d *dbFlags) open(ctx context.Context, applicationName string) (*pgxpool.Pool, error) {
	if err := d.validate(); err != nil {
		return nil, err
	}
	cfg, err := pgxpool.ParseConfig(d.url)
	if err != nil {
		return nil, pgsql.RedactError(fmt.Errorf("parse database URL: %w", err), d.url)
	}
	if cfg.ConnConfig.RuntimeParams["application_name"] == "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = applicationName
	}
	// TCP keepalives find a peer that vanished without closing (a NAT or firewall that dropped
	// the flow, a server host that died) within about 30 s on an idle connection, instead of
	// the kernel's default of two hours; statements in flight are bounded by the commands' own
	// timeouts (relay.Config.StatementTimeout).
	dialer := &net.Dialer{Timeout: 10 * time.Second,
		KeepAliveConfig: net.KeepAliveConfig{Enable: true, Idle: 15 * time.Second, Interval: 5 * time.Second, Count: 3}}
	cfg.ConnConfig.DialFunc = dialer.DialContext
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, pgsql.RedactError(fmt.Errorf("connect to database: %w", err), d.url)
	}
	return pool, nil
}

// connectMigrated is connect for the commands that use onceflow's tables: a schema without
// every migration step is refused with migrations.Validate's error, which names the steps
// and the command to run, instead of failing later on a missing table.
func (d *dbFlags) connectMigrated(ctx context.Context, applicationName string) (*pgxpool.Pool, error) {
	pool, err := d.connect(ctx, applicationName)
	if err != nil {
		return nil, err
	}
	if err := migrations.Validate(ctx, pool, d.migrationOptions()); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// migrationOptions are the options of the schema's migrations; warnings (steps a newer
// onceflow applied) go to stderr.
func (d *dbFlags) migrationOptions() migrations.Options {
	return migrations.Options{Schema: d.schema, Logger: slog.New(slog.NewTextHandler(d.c.stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
}

// secrets are the connection strings an invocation has seen (DATABASE_URL, --database-url)
// and its other secrets (the Kafka SASL password).
type secrets struct {
	mu       sync.Mutex
	dsns     []string
	literals []string
}

// addLiteral remembers a secret that is masked wherever it appears. Like the passwords of
// connection strings, one shorter than 3 characters is not: masking it everywhere would
// garble the text while hiding little.
func (s *secrets) addLiteral(secret string) {
	if s == nil || len(secret) < 3 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.literals = append(s.literals, secret)
}

// add remembers dsn. A nil *secrets (a cli built by hand in a test) remembers nothing.
func (s *secrets) add(dsn string) {
	if s == nil || dsn == "" {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.dsns = append(s.dsns, dsn)
}

func (s *secrets) mask(text string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, l := range s.literals {
		text = strings.ReplaceAll(text, l, "xxxxx")
	}
	if len(s.dsns) == 0 {
		return pgsql.RedactDSN(text)
	}
	for _, dsn := range s.dsns {
		text = pgsql.Redact(text, dsn)
	}
	return text
}

// maskingWriter masks passwords in everything written through it: any connection string's,
// and the passwords of the connection strings the invocation has seen wherever they appear.
// It is the net under the masking at the source (usage text, connect errors), for messages
// a library or the server composed, such as a relay's logged errors.
type maskingWriter struct {
	w io.Writer
	s *secrets
}

func (m *maskingWriter) Write(p []byte) (int, error) {
	masked := m.s.mask(string(p))
	if _, err := io.WriteString(m.w, masked); err != nil {
		return 0, err
	}
	return len(p), nil
}

// maxLimit is the largest --limit: a listing is one page, and the next page is asked for
// with the cursor the listing prints (--after), so no command reads a whole table at once.
const maxLimit = 1000

// addLimitFlag is every listing's --limit, with one meaning everywhere: list at most N rows,
// N from 1 to maxLimit. 0 is refused rather than read as "none" or "all": the two readings
// commands used to give it.
func addLimitFlag(fs *flag.FlagSet, def int, what string) *int {
	return fs.Int("limit", def, fmt.Sprintf("%s to list, 1 to %d (the listing says how to get the next page)", what, maxLimit))
}

func checkLimit(n int) error {
	if n < 1 || n > maxLimit {
		return fmt.Errorf("--limit is %d; it must be between 1 and %d (page on with the cursor the listing prints)", n, maxLimit)
	}
	return nil
}
