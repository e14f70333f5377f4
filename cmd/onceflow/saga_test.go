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
	for _, want := range []string{"stuck at step reserve", "stock service unavailable", "charge  ", "failed: card declined", "release", "compensation"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("saga show does not mention %q:\n%s", want, r.stdout)
		}
	}
	runCmd(ctx, env, "saga", "compensate", "o-1").expect(t, "compensate a stuck saga", 1)
	runCmd(ctx, env, "saga", "show", "nope").expect(t, "show an unknown saga", 1)
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
