package main

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

// versionLine returns the fields of the `saga versions` row of name and version, or nil.
func versionLine(out, name, version string) []string {
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) > 2 && f[0] == name && f[1] == version {
			return f
		}
	}
	return nil
}

// `saga versions` lists the live versions with their counts and orchestrators;
// --require-registered exits 4 naming a live version the list lacks and 0 when it has them
// all; finished sagas and stale orchestrator rows do not count; bad lists are usage errors.
func TestSagaVersionsCommand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	env := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema}
	build := func(o order) (any, error) { return o, nil }
	define := func(name string, version int) *saga.Definition[order] {
		return saga.MustDefine(name, version, []*saga.StepDef[order]{saga.Step[order]("reserve").Send(name+".reserve", build)})
	}
	co1, co2, refund1 := define("checkout", 1), define("checkout", 2), define("refund", 1)
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	start := func(def *saga.Definition[order], id string, state saga.State) {
		t.Helper()
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			if _, err := saga.StartTx(ctx, tx, def, order{ID: id}, saga.WithID(id), saga.WithWriter(w)); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `UPDATE `+db.Table("saga")+` SET state = $2 WHERE id = $1`, id, string(state))
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	start(co1, "old-1", saga.StateRunning)
	start(co1, "old-2", saga.StateStuck)
	start(co2, "new-1", saga.StateRunning)
	start(refund1, "refund-1", saga.StateCompleted)
	// A process that died an hour ago without stopping; it registered refund:1.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("saga_orchestrator")+` (id, consumer, host, pid, definitions, seen_at, expires_at)
		VALUES ('dead', 'onceflow-saga', 'gone-host', 1, '[{"name": "refund", "version": 1}]', now() - interval '1 hour', now() - interval '59 minutes')`); err != nil {
		t.Fatal(err)
	}

	orch, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: db.Pool, Schema: db.Schema, Consumer: "checkout-orchestrator"})
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []*saga.Definition[order]{co1, co2} {
		if err := saga.Register(orch, d); err != nil {
			t.Fatal(err)
		}
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- orch.Run(runCtx) }()
	stopped := false
	stopRun := func() {
		if !stopped {
			stopped = true
			stop()
			if err := <-done; err != nil {
				t.Errorf("Run: %v", err)
			}
		}
	}
	t.Cleanup(stopRun)

	var r result
	testutil.AwaitWithin(t, 10*time.Second, "saga versions lists the running orchestrator", func() bool {
		r = runCmd(ctx, env, "saga", "versions").expect(t, "saga versions", 0)
		return strings.Contains(r.stdout, "checkout-orchestrator")
	}, func() string { return r.stdout })
	for _, c := range []struct{ name, version, want string }{
		{"checkout", "1", "checkout 1 1 0 1 old-1"},
		{"checkout", "2", "checkout 2 1 0 0 new-1"},
	} {
		f := versionLine(r.stdout, c.name, c.version)
		if got := strings.Join(f[:min(len(f), 6)], " "); got != c.want {
			t.Errorf("saga versions row of %s:%s is %q; want %q ...:\n%s", c.name, c.version, got, c.want, r.stdout)
		}
		if !strings.Contains(strings.Join(f, " "), ":"+strconv.Itoa(os.Getpid())) {
			t.Errorf("saga versions row of %s:%s does not name this process's orchestrator (host:pid):\n%s", c.name, c.version, r.stdout)
		}
	}
	if versionLine(r.stdout, "refund", "1") != nil || strings.Contains(r.stdout, "gone-host") {
		t.Errorf("saga versions lists refund:1 (finished sagas only, registered by a stale orchestrator):\n%s", r.stdout)
	}
	if !strings.Contains(r.stdout, "LIVE ORCHESTRATOR") || strings.Contains(r.stdout, "! ") {
		t.Errorf("saga versions: want the live orchestrator listed and no warning:\n%s", r.stdout)
	}

	// The build without checkout:1: exit 4, checkout:1 named with its counts and what to do.
	r = runCmd(ctx, env, "saga", "versions", "--require-registered", "checkout:2").expect(t, "require checkout:2 alone", exitVersionsMissing)
	for _, want := range []string{"onceflow saga: schema \"" + db.Schema + "\" has sagas that have not finished on a definition version missing from the list: " +
		"checkout:1 (2 not finished: 1 running, 0 compensating, 1 stuck; oldest old-1", "until `onceflow saga versions` shows no saga not finished for it"} {
		if !strings.Contains(r.stderr, want) {
			t.Errorf("require checkout:2 alone: stderr does not say %q:\n%s", want, r.stderr)
		}
	}
	if strings.Contains(r.stderr, "refund") || strings.Contains(r.stderr, "saga: saga:") {
		t.Errorf("require checkout:2 alone: stderr %q names refund or repeats the prefix", r.stderr)
	}
	// Every live version in the list, in one flag or several: exit 0.
	for _, args := range [][]string{
		{"--require-registered", "checkout:1,checkout:2"},
		{"--require-registered", "checkout:2", "--require-registered=checkout:1, refund:1"},
	} {
		r = runCmd(ctx, env, append([]string{"saga", "versions"}, args...)...).expect(t, strings.Join(args, " "), 0)
		if !strings.Contains(r.stdout, "ok: every version with sagas not finished is in --require-registered") {
			t.Errorf("%q: stdout does not say the check passed:\n%s", args, r.stdout)
		}
	}

	// Bad input: a usage error that says what is wrong, and no check.
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--require-registered", "checkout"}, `"checkout" has no version`},
		{[]string{"--require-registered", ""}, "the version list is empty"},
		{[]string{"--require-registered", "checkout:0"}, `version "0" is not a positive whole number`},
		{[]string{"checkout:1"}, "unexpected arguments"},
	} {
		r = runCmd(ctx, env, append([]string{"saga", "versions"}, c.args...)...).expect(t, strings.Join(c.args, " "), 2)
		if !strings.Contains(r.stderr, c.want) || r.stdout != "" {
			t.Errorf("%q: stderr does not say %q (or something went to stdout):\nstdout:\n%s\nstderr:\n%s", c.args, c.want, r.stdout, r.stderr)
		}
	}

	// The orchestrator stops: its row goes, and the live versions are served by none.
	stopRun()
	r = runCmd(ctx, env, "saga", "versions").expect(t, "saga versions without an orchestrator", 0)
	if f := versionLine(r.stdout, "checkout", "1"); len(f) == 0 || f[len(f)-1] != "none" ||
		!strings.Contains(r.stdout, "! checkout:1 has 2 sagas not finished and no live orchestrator registers it") ||
		strings.Contains(r.stdout, "LIVE ORCHESTRATOR") {
		t.Errorf("saga versions after the orchestrator stopped:\n%s", r.stdout)
	}
}
