package main

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/migrations"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// invocation is one in-process run of the CLI with its own output and environment, so tests
// run in parallel and may read the output while the command still runs.
type invocation struct {
	stdout, stderr testutil.SyncBuffer
	done           chan int
}

// start runs the command line in a goroutine. env is the whole environment the command sees:
// nothing leaks in from the test process (whose DATABASE_URL, for one, the tests must not use).
func start(ctx context.Context, env map[string]string, args ...string) *invocation {
	inv := &invocation{done: make(chan int, 1)}
	getenv := func(name string) string { return env[name] }
	go func() { inv.done <- run(ctx, args, getenv, &inv.stdout, &inv.stderr) }()
	return inv
}

// result is what a finished invocation returned and printed.
type result struct {
	code           int
	stdout, stderr string
}

// runCmd runs the command line to its end.
func runCmd(ctx context.Context, env map[string]string, args ...string) result {
	inv := start(ctx, env, args...)
	code := <-inv.done
	return result{code: code, stdout: inv.stdout.String(), stderr: inv.stderr.String()}
}

// expect fails the test unless the command exited with want; it shows the output if not.
func (r result) expect(t *testing.T, what string, want int) result {
	t.Helper()
	if r.code != want {
		t.Fatalf("%s exited %d, want %d\nstdout:\n%s\nstderr:\n%s", what, r.code, want, r.stdout, r.stderr)
	}
	return r
}

func stepName(m migrations.Migration) string { return fmt.Sprintf("%04d_%s", m.Version, m.Name) }

func TestMigrateCommand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewEmpty(t)
	// The connection comes from the environment, as in a deploy script.
	env := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema}

	// A fresh schema: status lists every step as pending and exits 3 with the command to run.
	r := runCmd(ctx, env, "migrate", "status").expect(t, "status before up", exitPending)
	if n := strings.Count(r.stdout, "pending"); n != len(migrations.All()) {
		t.Errorf("status lists %d pending steps, want %d:\n%s", n, len(migrations.All()), r.stdout)
	}
	if want := "onceflow migrate up --schema " + db.Schema; !strings.Contains(r.stderr, want) {
		t.Errorf("status does not say to run %q:\n%s", want, r.stderr)
	}

	r = runCmd(ctx, env, "migrate", "up").expect(t, "migrate up", 0)
	for _, m := range migrations.All() {
		if !strings.Contains(r.stdout, "applied "+stepName(m)) {
			t.Errorf("migrate up does not report %s:\n%s", stepName(m), r.stdout)
		}
	}
	r = runCmd(ctx, env, "migrate", "up").expect(t, "second migrate up", 0)
	if !strings.Contains(r.stdout, "is up to date") {
		t.Errorf("second migrate up: %s", r.stdout)
	}
	if err := migrations.Validate(ctx, db.Pool, migrations.Options{Schema: db.Schema}); err != nil {
		t.Fatalf("after migrate up: %v", err)
	}
	r = runCmd(ctx, env, "migrate", "status").expect(t, "status after up", 0)
	if strings.Contains(r.stdout, "pending") || r.stderr != "" {
		t.Errorf("status after up:\nstdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	}

	// A step a newer onceflow applied: listed and warned about, but not a failure.
	if _, err := db.Pool.Exec(ctx, "INSERT INTO "+db.Schema+".schema_migration (version, name) VALUES (9999, 'from_the_future')"); err != nil {
		t.Fatal(err)
	}
	r = runCmd(ctx, env, "migrate", "status").expect(t, "status of a newer schema", 0)
	if !strings.Contains(r.stdout, "from_the_future") || !strings.Contains(r.stdout, "newer onceflow") || !strings.Contains(r.stderr, "level=WARN") {
		t.Errorf("status of a newer schema:\nstdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	}
	// One step missing again: 3, and the step is named.
	last := migrations.All()[len(migrations.All())-1]
	if _, err := db.Pool.Exec(ctx, "DELETE FROM "+db.Schema+".schema_migration WHERE version = $1", last.Version); err != nil {
		t.Fatal(err)
	}
	r = runCmd(ctx, env, "migrate", "status").expect(t, "status with a step missing", exitPending)
	if !strings.Contains(r.stderr, stepName(last)) {
		t.Errorf("status does not name the pending step %s:\n%s", stepName(last), r.stderr)
	}

	// Flags override the environment; bad input is refused.
	r = runCmd(ctx, env, "migrate", "up", "--schema", "Bad-Name").expect(t, "bad schema", 1)
	if !strings.Contains(r.stderr, "invalid schema name") {
		t.Errorf("bad schema: %s", r.stderr)
	}
	r = runCmd(ctx, nil, "migrate", "status", "--schema", db.Schema).expect(t, "status without a database", 1)
	if !strings.Contains(r.stderr, "DATABASE_URL") {
		t.Errorf("status without a database: %s", r.stderr)
	}
	runCmd(ctx, nil, "migrate", "sideways").expect(t, "unknown action", 2)
	runCmd(ctx, nil, "nope").expect(t, "unknown command", 2)
	runCmd(ctx, nil).expect(t, "no command", 2)
}

func TestMigratePrint(t *testing.T) {
	t.Parallel()
	r := runCmd(context.Background(), map[string]string{"ONCEFLOW_SCHEMA": "shop_events"}, "migrate", "print").expect(t, "migrate print", 0)
	if !strings.Contains(r.stdout, `CREATE TABLE IF NOT EXISTS "shop_events".outbox`) || r.stderr != "" {
		t.Errorf("migrate print:\nstdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	}
}
