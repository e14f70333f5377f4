package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/migrations"
)

// everyHelp lists a help invocation of the top level and of every command and action.
var everyHelp = [][]string{
	{"-h"}, {"--help"}, {"help"},
	{"migrate", "-h"}, {"migrate", "--help"}, {"migrate", "up", "-h"}, {"migrate", "status", "--help"},
	{"relay", "-h"}, {"relay", "--help"},
	{"outbox", "-h"}, {"outbox", "--help"},
	{"outbox", "inspect", "-h"}, {"outbox", "parked", "-h"}, {"outbox", "replay", "--help"}, {"outbox", "scheduled", "-h"},
	{"cleanup", "-h"}, {"cleanup", "--help"},
	{"topics", "-h"}, {"topics", "--help"}, {"topics", "create", "-h"}, {"topics", "list", "--help"},
	{"inbox", "-h"}, {"inbox", "poison", "-h"}, {"inbox", "poison", "list", "--help"}, {"inbox", "poison", "delete", "-h"}, {"inbox", "poison", "replay", "-h"},
	{"inbox", "parked", "-h"}, {"inbox", "parked", "release", "--help"},
	{"saga", "-h"}, {"saga", "--help"}, {"saga", "list", "-h"}, {"saga", "show", "-h"}, {"saga", "retry", "-h"}, {"saga", "compensate", "--help"},
	{"saga", "versions", "-h"},
	{"ui", "-h"}, {"ui", "--help"},
}

// No command prints the database password: not in usage text (the flag default comes from
// DATABASE_URL), not after a mistyped flag, not in the error of a connection that fails or a
// connection string that does not parse.
func TestNoPasswordInOutput(t *testing.T) {
	t.Parallel()
	const secret = "Pw9fK2qZ"
	dsns := []string{
		"postgres://onceflow:" + secret + "@127.0.0.1:1/shop?sslmode=disable",               // refused
		"postgres://onceflow:" + secret + "@127.0.0.1:notaport/shop",                        // does not parse
		"postgres://127.0.0.1:1/shop?sslmode=disable&password=" + secret,                    // query form
		"host=127.0.0.1 port=1 user=onceflow password=" + secret + " dbname=shop",           // keyword form
		"host=127.0.0.1 port=1 user=onceflow password='" + secret + " x' sslmode=disable",   // quoted
		"postgres://onceflow:" + secret + "@127.0.0.1:1/shop?sslmode=disable&port=nonsense", // bad param
	}
	var cmds [][]string
	cmds = append(cmds, everyHelp...)
	cmds = append(cmds, [][]string{
		{}, {"--nope"}, {"nope"},
		{"migrate"}, {"migrate", "up", "--nope"}, {"migrate", "up"}, {"migrate", "status"},
		{"relay", "--nope"}, {"relay", "--kafka-brokers", "127.0.0.1:1"}, {"relay", "--batch-size", "x"},
		{"outbox", "inspect", "--nope"}, {"outbox", "inspect"}, {"outbox", "parked"}, {"outbox", "replay", "--all"},
		{"cleanup", "--nope"}, {"cleanup", "--batch-size", "x"}, {"cleanup"},
		{"inbox", "poison"}, {"inbox", "poison", "--nope"}, {"inbox", "poison", "delete", "--id", "1"},
		{"inbox", "parked"}, {"inbox", "parked", "--count"}, {"inbox", "parked", "release", "--id", "1"},
		{"saga", "list"}, {"saga", "retry", "--state", "stuck", "--dry-run"}, {"cleanup", "--dry-run"}, {"ui"},
		{"saga", "versions"}, {"saga", "versions", "--require-registered", "checkout:1"}, {"saga", "versions", "--require-registered", "checkout"},
	}...)
	var mu sync.Mutex
	var leaks []string
	t.Cleanup(func() {
		if len(leaks) > 0 {
			t.Errorf("the password was printed by %d of %d invocations:\n%s", len(leaks), len(cmds)*len(dsns)*2, strings.Join(leaks, "\n"))
		}
	})
	for i, dsn := range dsns {
		for _, args := range cmds {
			// From the environment, and from the flag (which then shows in no default).
			for _, viaFlag := range []bool{false, true} {
				t.Run(fmt.Sprintf("%d/%s/flag=%t", i, strings.Join(args, "_"), viaFlag), func(t *testing.T) {
					t.Parallel()
					env := map[string]string{"DATABASE_URL": dsn}
					full := args
					if viaFlag && len(args) > 0 && !strings.HasPrefix(args[0], "-") && args[0] != "help" && args[0] != "nope" {
						env = nil
						full = append(slices.Clone(args), "--database-url", dsn)
					}
					ctx := context.Background()
					if len(args) > 0 && args[0] == "relay" {
						// A relay waits for an unreachable database (logging why) until stopped.
						var cancel context.CancelFunc
						ctx, cancel = context.WithTimeout(ctx, 1500*time.Millisecond)
						defer cancel()
					}
					r := runCmd(ctx, env, full...)
					if out := r.stdout + r.stderr; strings.Contains(out, secret) {
						mu.Lock()
						leaks = append(leaks, fmt.Sprintf("  %q with %q: %s", full, dsn, firstLineWith(out, secret)))
						mu.Unlock()
					}
				})
			}
		}
	}
}

// No command prints the Kafka SASL password, from the environment or from a file: not in
// usage text, not after a mistake, not in the errors of a cluster that refuses it, and not
// when it reaches a message by another path (typed as the user name).
func TestNoKafkaPasswordInOutput(t *testing.T) {
	t.Parallel()
	s := newSecuredKafka(t) // wants kafkaSecret; every attempt below fails
	var cmds [][]string
	cmds = append(cmds, everyHelp...)
	cmds = append(cmds, [][]string{
		{"relay", "--nope"}, {"relay", "--batch-size", "x"}, {"relay", "--kafka-sasl-mechanism", "nope"},
		{"relay", "--kafka-sasl-password", "x"}, {"relay", "--kafka-brokers", s.brokers, "--kafka-sasl-mechanism", "PLAIN", "--kafka-sasl-user", "relay"},
		{"topics", "create", "--nope"}, {"topics", "create"}, {"topics", "list", "--kafka-sasl-mechanism", "SCRAM-SHA-256"},
		{"topics", "list", "--timeout", "3s", "--kafka-brokers", s.brokers, "--kafka-tls-ca-file", s.pki.CAFile, "--kafka-tls-server-name", s.pki.ServerName,
			"--kafka-tls-cert-file", s.pki.ClientCertFile, "--kafka-tls-key-file", s.pki.ClientKeyFile, "--kafka-sasl-mechanism", "SCRAM-SHA-512"},
	}...)
	for _, args := range cmds {
		for _, via := range []string{"env", "file"} {
			t.Run(strings.Join(args, "_")+"/"+via, func(t *testing.T) {
				t.Parallel()
				secret := "wrong-" + kafkaSecret
				// A database that is down: the relay gets as far as pinging Kafka, then waits.
				env := map[string]string{"DATABASE_URL": "postgres://u@127.0.0.1:1/db?sslmode=disable"}
				if via == "env" {
					env["ONCEFLOW_KAFKA_SASL_PASSWORD"] = secret
				} else {
					path := filepath.Join(t.TempDir(), "pw")
					if err := os.WriteFile(path, []byte(secret), 0o600); err != nil {
						t.Fatal(err)
					}
					env["ONCEFLOW_KAFKA_SASL_PASSWORD_FILE"] = path
				}
				full := slices.Clone(args)
				if slices.Contains(args, "--kafka-brokers") {
					// The password typed as the user name too: the errors name the user.
					full = append(full, "--kafka-sasl-user", secret)
				}
				ctx, cancel := context.WithTimeout(context.Background(), 4*time.Second)
				defer cancel()
				r := runCmd(ctx, env, full...)
				out := r.stdout + r.stderr
				if strings.Contains(out, secret) {
					t.Errorf("%q printed the password: %s", full, firstLineWith(out, secret))
				}
				if len(full) > len(args) && !strings.Contains(out, `user \"xxxxx\"`) && !strings.Contains(out, `user "xxxxx"`) {
					t.Errorf("%q: no masked user name in the output, so this case tests nothing:\n%s", full, out)
				}
			})
		}
	}
}

func firstLineWith(s, sub string) string {
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			return strings.TrimSpace(l)
		}
	}
	return ""
}

// Help asked for is the output: stdout, exit 0, nothing on stderr. Help after a mistake is
// the diagnosis: stderr, exit 2.
func TestHelpOnStdout(t *testing.T) {
	t.Parallel()
	for _, args := range everyHelp {
		t.Run(strings.Join(args, "_"), func(t *testing.T) {
			t.Parallel()
			r := runCmd(context.Background(), nil, args...)
			if r.code != 0 || !strings.Contains(r.stdout, "Usage: onceflow") || r.stderr != "" {
				t.Errorf("%q: exit %d\nstdout:\n%s\nstderr:\n%s", args, r.code, r.stdout, r.stderr)
			}
		})
	}
	for _, args := range [][]string{{}, {"--nope"}, {"nope"}, {"migrate"}, {"migrate", "up", "--nope"}, {"relay", "--nope"},
		{"outbox"}, {"outbox", "inspect", "--nope"}, {"cleanup", "--nope"}, {"inbox"}, {"inbox", "poison", "--nope"}, {"inbox", "parked", "--nope"}} {
		r := runCmd(context.Background(), nil, args...)
		if r.code != 2 || r.stdout != "" || !strings.Contains(r.stderr, "Usage: onceflow") {
			t.Errorf("%q: exit %d\nstdout:\n%s\nstderr:\n%s", args, r.code, r.stdout, r.stderr)
		}
	}
	// The top-level help says what cleanup deletes: both tables.
	r := runCmd(context.Background(), nil, "--help")
	if !strings.Contains(r.stdout, "dedup rows") || !strings.Contains(r.stdout, "idempotency records") {
		t.Errorf("top-level help does not say cleanup deletes dedup rows and idempotency records:\n%s", r.stdout)
	}
}

func TestVersion(t *testing.T) {
	t.Parallel()
	for _, arg := range []string{"--version", "-version", "version"} {
		r := runCmd(context.Background(), nil, arg)
		// A test binary has no module version: it is a development build.
		if r.code != 0 || !regexp.MustCompile(`^onceflow \S+`).MatchString(r.stdout) || !strings.Contains(r.stdout, "(devel)") || r.stderr != "" {
			t.Errorf("%s: exit %d\nstdout:\n%s\nstderr:\n%s", arg, r.code, r.stdout, r.stderr)
		}
	}
}

// Every environment variable a command reads is named in brackets on the flag it sets, and
// no flag names one it does not read; the heading does not promise one on every flag.
func TestUsageNamesEveryEnvironmentVariable(t *testing.T) {
	t.Parallel()
	bracket := regexp.MustCompile(`\[([A-Z][A-Z0-9_]+)\]`)
	for _, args := range everyHelp {
		if len(args) < 2 || (args[0] == "outbox" || args[0] == "topics") && len(args) == 2 {
			continue // the top level and the action lists have no flags
		}
		var mu sync.Mutex
		read := map[string]bool{}
		getenv := func(name string) string {
			mu.Lock()
			defer mu.Unlock()
			read[name] = true
			return ""
		}
		var inv invocation
		if code := run(context.Background(), args, getenv, &inv.stdout, &inv.stderr); code != 0 {
			t.Fatalf("%q: exit %d", args, code)
		}
		usage := inv.stdout.String()
		shown := map[string]bool{}
		for _, m := range bracket.FindAllStringSubmatch(usage, -1) {
			shown[m[1]] = true
		}
		if !strings.Contains(usage, "-database-url") {
			// Read by run for every command, to mask its password, not as a setting.
			delete(read, "DATABASE_URL")
		}
		for name := range read {
			if !shown[name] {
				t.Errorf("%q reads %s but its usage does not show it:\n%s", args, name, usage)
			}
		}
		for name := range shown {
			if !read[name] {
				t.Errorf("%q shows [%s] but does not read it", args, name)
			}
		}
		if strings.Contains(usage, "Flags (environment variable in brackets)") {
			t.Errorf("%q: the heading promises an environment variable on every flag:\n%s", args, usage)
		}
	}
}

// An unmigrated schema: every command that needs the tables says what to run instead of
// showing PostgreSQL's "relation does not exist".
func TestUnmigratedSchemaSaysWhatToRun(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewEmpty(t)
	env := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema}
	want := "onceflow migrate up --schema " + db.Schema
	for _, c := range []struct {
		args []string
		code int
	}{
		{[]string{"outbox", "inspect"}, 1},
		{[]string{"outbox", "parked"}, 1},
		{[]string{"outbox", "scheduled"}, 1},
		{[]string{"outbox", "scheduled", "--count"}, 1},
		{[]string{"outbox", "replay", "--all"}, 1},
		{[]string{"outbox", "replay", "--all", "--dry-run"}, 1},
		{[]string{"cleanup"}, 1},
		{[]string{"cleanup", "--only", "idempotency_record"}, 1},
		{[]string{"inbox", "poison"}, 1},
		{[]string{"inbox", "poison", "delete", "--id", "1"}, 1},
		{[]string{"inbox", "poison", "replay", "--all"}, 1},
		{[]string{"inbox", "parked"}, 1},
		{[]string{"inbox", "parked", "--count"}, 1},
		{[]string{"inbox", "parked", "release", "--id", "1"}, 1},
		{[]string{"inbox", "parked", "release", "--consumer", "billing"}, 1},
		{[]string{"relay", "--kafka-brokers", "127.0.0.1:1"}, 1},
		{[]string{"saga", "versions", "--require-registered", "checkout:1"}, 1},
		{[]string{"migrate", "status"}, exitPending},
	} {
		r := runCmd(ctx, env, c.args...)
		if r.code != c.code || !strings.Contains(r.stderr, want) || strings.Contains(r.stderr, "42P01") || strings.Contains(r.stderr, "does not exist") {
			t.Errorf("%q on an unmigrated schema: exit %d (want %d), stderr does not just say to run %q:\n%s", c.args, r.code, c.code, want, r.stderr)
		}
	}
	// Nothing was created by the commands that refused.
	var tables int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_tables WHERE schemaname = $1`, db.Schema).Scan(&tables); err != nil {
		t.Fatal(err)
	}
	if tables != 0 {
		t.Errorf("%d tables in the unmigrated schema after the commands", tables)
	}
	if _, err := migrations.Up(ctx, db.Pool, migrations.Options{Schema: db.Schema}); err != nil {
		t.Fatal(err)
	}
	runCmd(ctx, env, "outbox", "inspect").expect(t, "inspect after migrate up", 0)
}

// outbox inspect on an empty outbox reads naturally; with rows pending and no live relay it
// warns that nothing publishes them.
func TestOutboxInspectEmptyAndUnattended(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	env := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema}
	r := runCmd(ctx, env, "outbox", "inspect").expect(t, "inspect of an empty outbox", 0)
	if !strings.Contains(r.stdout, "pending: 0 rows") || strings.Contains(r.stdout, "oldest") || strings.Contains(r.stdout+r.stderr, "no relay") {
		t.Errorf("inspect of an empty outbox:\nstdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Schema+`.outbox (event_id, topic, key_hash, payload) VALUES (gen_random_uuid(), 'orders', 1, 'x')`); err != nil {
		t.Fatal(err)
	}
	r = runCmd(ctx, env, "outbox", "inspect").expect(t, "inspect with a pending row", 0)
	if !strings.Contains(r.stdout, "pending: 1 rows (oldest ") || !strings.Contains(r.stderr, "no relay is live") || !strings.Contains(r.stderr, "onceflow relay") {
		t.Errorf("inspect with a pending row and no relay:\nstdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	}
	// A dead relay's member row does not count; a live one silences the warning.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Schema+`.relay_member (id, expires_at) VALUES ('dead', now() - interval '1 minute')`); err != nil {
		t.Fatal(err)
	}
	r = runCmd(ctx, env, "outbox", "inspect").expect(t, "inspect with a dead relay", 0)
	if !strings.Contains(r.stderr, "no relay is live") {
		t.Errorf("inspect with only a dead relay does not warn:\n%s", r.stderr)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Schema+`.relay_member (id, expires_at) VALUES ('live', now() + interval '1 minute')`); err != nil {
		t.Fatal(err)
	}
	r = runCmd(ctx, env, "outbox", "inspect").expect(t, "inspect with a live relay", 0)
	if strings.Contains(r.stderr, "no relay") {
		t.Errorf("inspect warns although a relay is live:\n%s", r.stderr)
	}
}
