package main

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
	"github.com/onceflow/onceflow/saga/sagatest"
)

type order struct {
	ID string `json:"id"`
}

// A saga whose compensation keeps failing is stuck: `saga list --state stuck` and `saga show`
// show it with its error; `saga retry` resumes it once the cause is fixed.
func TestSagaCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	env := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema}
	build := func(o order) (any, error) { return o, nil }
	def := saga.MustDefine("checkout", 1, []*saga.StepDef[order]{
		saga.Step[order]("reserve").Send("reserve", build).Compensate("release", build),
		saga.Step[order]("charge").Send("charge", build),
	}, saga.WithCompensationAttempts(1, time.Millisecond))
	orch, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: db.Pool, Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := saga.Register(orch, def); err != nil {
		t.Fatal(err)
	}
	p, err := saga.NewParticipant(saga.ParticipantConfig{Pool: db.Pool, Schema: db.Schema, Consumer: "svc"})
	if err != nil {
		t.Fatal(err)
	}
	releaseWorks := false
	bus := sagatest.NewBus(db.Pool, db.Schema)
	bus.Orchestrate(orch)
	bus.Subscribe("reserve", saga.Action(p, func(context.Context, pgx.Tx, order) (struct{}, error) { return struct{}{}, nil }))
	bus.Subscribe("charge", saga.Action(p, func(context.Context, pgx.Tx, order) (struct{}, error) { return struct{}{}, saga.Fail("card declined") }))
	bus.Subscribe("release", saga.Compensation(p, func(context.Context, pgx.Tx, order) error {
		if !releaseWorks {
			return saga.Retry(errors.New("stock service unavailable"))
		}
		return nil
	}))
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := saga.StartTx(ctx, tx, def, order{ID: "o-1"}, saga.WithID("o-1"), saga.WithWriter(w))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	state := func() saga.State {
		a, _ := saga.NewAdmin(db.Schema)
		d, err := a.Get(ctx, db.Pool, "o-1")
		if err != nil {
			t.Fatal(err)
		}
		return d.State
	}
	if err := bus.RunUntil(ctx, func() bool { return state() == saga.StateStuck }); err != nil {
		t.Fatal(err)
	}

	r := runCmd(ctx, env, "saga", "list", "--state", "stuck").expect(t, "saga list", 0)
	if !strings.Contains(r.stdout, "o-1") || !strings.Contains(r.stdout, "stock service unavailable") {
		t.Errorf("saga list --state stuck:\n%s", r.stdout)
	}
	r = runCmd(ctx, env, "saga", "show", "o-1").expect(t, "saga show", 0)
	for _, want := range []string{"stuck at step reserve\n", "stock service unavailable", "charge  ", "failed: card declined", "release", "compensation",
		"waiting for: an operator: the compensation of step reserve did not succeed in 1 attempt; fix the cause, then `onceflow saga retry o-1`"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("saga show does not mention %q:\n%s", want, r.stdout)
		}
	}
	// The replies applied, in order, with the participants' reasons.
	replies := r.stdout[max(0, strings.Index(r.stdout, "REPLIES APPLIED")):]
	if a, b, c := strings.Index(replies, "reserve  action        1        done"), strings.Index(replies, "charge   action        1        failed   "),
		strings.Index(replies, "reserve  compensation  1        retry"); a < 0 || b < a || c < b || !strings.Contains(replies, "card declined") {
		t.Errorf("saga show does not list the replies applied in order:\n%s", r.stdout)
	}
	// The commands in the order they were written: reserve, charge, then reserve's compensation.
	if a, b := strings.Index(r.stdout, "charge   action"), strings.Index(r.stdout, "reserve  compensation"); a < 0 || b < 0 || a > b {
		t.Errorf("saga show does not list the commands in time order (charge's action, then reserve's compensation):\n%s", r.stdout)
	}
	runCmd(ctx, env, "saga", "compensate", "o-1").expect(t, "compensate a stuck saga", 1)
	r = runCmd(ctx, env, "saga", "show", "nope").expect(t, "show an unknown saga", 1)
	if !strings.Contains(r.stderr, "onceflow saga: no saga with this id") || strings.Contains(r.stderr, "saga: saga:") {
		t.Errorf("show an unknown saga: stderr %q; want one prefix", r.stderr)
	}

	// A retry whose compensation fails again: stuck again, and every count says the same
	// (the command's attempt number), with the attempts since the retry.
	r = runCmd(ctx, env, "saga", "retry", "o-1").expect(t, "saga retry", 0)
	r = runCmd(ctx, env, "saga", "show", "o-1").expect(t, "saga show", 0)
	if want := "a retry request is filed, due "; !strings.Contains(r.stdout, want) {
		t.Errorf("saga show after saga retry does not say %q:\n%s", want, r.stdout)
	}
	if err := bus.RunUntil(ctx, func() bool {
		a, _ := saga.NewAdmin(db.Schema)
		d, err := a.Get(ctx, db.Pool, "o-1")
		return err == nil && d.State == saga.StateStuck && d.Attempt == 2
	}); err != nil {
		t.Fatal(err)
	}
	r = runCmd(ctx, env, "saga", "show", "o-1").expect(t, "saga show", 0)
	for _, want := range []string{"(after 2 attempts, 1 of them since `onceflow saga retry`)", "did not succeed in 2 attempts",
		"reserve  compensation  2"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("saga show of a saga stuck again does not mention %q:\n%s", want, r.stdout)
		}
	}
	if strings.Contains(r.stdout, "(attempt ") || strings.Contains(r.stdout, "1 attempts") {
		t.Errorf("saga show counts attempts two ways:\n%s", r.stdout)
	}
	runCmd(ctx, env, "saga", "show").expect(t, "show without an id", 2)
	runCmd(ctx, env, "saga", "list", "--state", "lost").expect(t, "list with a bad state", 2)

	releaseWorks = true
	r = runCmd(ctx, env, "saga", "retry", "o-1").expect(t, "saga retry", 0)
	if !strings.Contains(r.stdout, "retry requested") {
		t.Errorf("saga retry: %s", r.stdout)
	}
	if err := bus.RunUntil(ctx, func() bool { return state() == saga.StateCompensated }); err != nil {
		t.Fatal(err)
	}
	r = runCmd(ctx, env, "saga", "show", "o-1", "--schema", db.Schema).expect(t, "saga show after retry", 0)
	if !strings.Contains(r.stdout, "compensated") {
		t.Errorf("saga show after retry:\n%s", r.stdout)
	}
	runCmd(ctx, env, "saga", "retry", "o-1").expect(t, "retry a compensated saga", 1)
}

// `saga show` says what a saga waits for: its command still in the outbox (no relay runs),
// parked, published and awaiting the reply, or a re-send after a failed attempt.
func TestSagaShowSaysWhatItWaitsFor(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	env := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema}
	build := func(o order) (any, error) { return o, nil }
	def := saga.MustDefine("checkout", 1, []*saga.StepDef[order]{
		saga.Step[order]("reserve").Send("reserve", build).Compensate("release", build).Timeout(time.Hour).Attempts(3, time.Hour),
		saga.Step[order]("charge").Send("charge", build),
	})
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"o-1", "o-2"} {
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			_, err := saga.StartTx(ctx, tx, def, order{ID: id}, saga.WithID(id), saga.WithWriter(w))
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	admin, err := saga.NewAdmin(db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	d, err := admin.Get(ctx, db.Pool, "o-1")
	if err != nil {
		t.Fatal(err)
	}
	event := d.Steps[0].Sent[0].EventID
	show := func(what string, wants ...string) {
		t.Helper()
		r := runCmd(ctx, env, "saga", "show", "o-1").expect(t, "saga show "+what, 0)
		for _, want := range wants {
			if !strings.Contains(r.stdout, want) {
				t.Errorf("saga show of a saga whose command is %s does not say %q:\n%s", what, want, r.stdout)
			}
		}
	}

	// No relay runs: the command sits in the outbox.
	show("in the outbox", "running at step reserve\n",
		"waiting for: a relay: its action command of step reserve (attempt 1, event "+event+") is still in the outbox, not yet published, written ",
		"the attempt times out at ", "is a relay running? `onceflow status` shows the relays, `onceflow outbox find "+event+"` the row")

	// The relay parked it.
	if _, err := db.Pool.Exec(ctx, `WITH m AS (DELETE FROM `+db.Table("outbox")+` WHERE event_id = $1 RETURNING *)
		INSERT INTO `+db.Table("outbox_parked")+` (id, event_id, topic, partition_key, key_hash, payload, metadata, created_at, attempts, last_error)
		SELECT id, event_id, topic, partition_key, key_hash, payload, metadata, created_at, 5, 'message too large' FROM m`, event); err != nil {
		t.Fatal(err)
	}
	show("parked", "waiting for: an operator: its action command of step reserve (attempt 1, event "+event+") was parked by the relay (message too large); `onceflow outbox replay --event-id "+event+"`")

	// Published: the participant's reply is awaited.
	if _, err := db.Pool.Exec(ctx, `DELETE FROM `+db.Table("outbox_parked")); err != nil {
		t.Fatal(err)
	}
	show("published", "waiting for: the reply to its action command of step reserve (attempt 1, event "+event+"), published; written ", "the attempt times out at ")

	// The participant asked for a retry: the re-send waits for its backoff.
	orch, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: db.Pool, Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := saga.Register(orch, def); err != nil {
		t.Fatal(err)
	}
	p, err := saga.NewParticipant(saga.ParticipantConfig{Pool: db.Pool, Schema: db.Schema, Consumer: "svc"})
	if err != nil {
		t.Fatal(err)
	}
	bus := sagatest.NewBus(db.Pool, db.Schema)
	bus.Orchestrate(orch)
	bus.Subscribe("reserve", saga.Action(p, func(context.Context, pgx.Tx, order) (struct{}, error) {
		return struct{}{}, saga.Retry(errors.New("stock service slow"))
	}))
	if err := bus.RunUntil(ctx, func() bool {
		d, err := admin.Get(ctx, db.Pool, "o-2")
		return err == nil && d.Wait != nil && d.Wait.For == saga.WaitResend
	}); err != nil {
		t.Fatal(err)
	}
	r := runCmd(ctx, env, "saga", "show", "o-2").expect(t, "saga show of a saga waiting to re-send", 0)
	if want := "waiting for: a re-send: attempt 1 of step reserve failed (retry: stock service slow); attempt 2 goes out at "; !strings.Contains(r.stdout, want) {
		t.Errorf("saga show does not say %q:\n%s", want, r.stdout)
	}
}

// `saga show` of a saga with local steps: the steps table marks them; a local first step not
// run yet waits for its first run, and one whose run failed waits for a re-run.
func TestSagaShowLocalSteps(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	env := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema}
	build := func(o order) (any, error) { return o, nil }
	def := saga.MustDefine("checkout", 1, []*saga.StepDef[order]{
		saga.Step[order]("place").Local(func(context.Context, pgx.Tx, *order) error { return errors.New("orders table locked") }).
			CompensateLocal(func(context.Context, pgx.Tx, *order) error { return nil }).Attempts(3, time.Hour),
		saga.Step[order]("charge").Send("charge", build),
	})
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := saga.StartTx(ctx, tx, def, order{ID: "o-1"}, saga.WithID("o-1"), saga.WithWriter(w))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	show := func(what string, wants ...string) {
		t.Helper()
		r := runCmd(ctx, env, "saga", "show", "o-1").expect(t, "saga show "+what, 0)
		for _, want := range wants {
			if !strings.Contains(r.stdout, want) {
				t.Errorf("saga show of a saga %s does not say %q:\n%s", what, want, r.stdout)
			}
		}
	}
	show("before its local first step ran", "waiting for: its first run: local step place runs in a transaction of an orchestrator's Run, due ",
		"place   pending (local)  0 ")

	orch, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: db.Pool, Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := saga.Register(orch, def); err != nil {
		t.Fatal(err)
	}
	if n, err := orch.FireDue(ctx); err != nil || n != 1 {
		t.Fatalf("fired %d timers: %v", n, err)
	}
	show("whose local step failed", "waiting for: a re-run: attempt 1 of local step place (action) failed and was rolled back (retry: orders table locked); attempt 2 runs in an orchestrator's transaction at ",
		"running (local)  1 ", "retry: orders table locked")
}
