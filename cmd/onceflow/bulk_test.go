package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
	"github.com/onceflow/onceflow/saga/sagatest"
)

// `saga retry --state stuck --dry-run` lists 20 stuck sagas and files nothing; without
// --dry-run one command resumes all 20, one transaction each; sagas the request does not
// apply to are reported, and a filter that selects nothing fails and says so.
func TestSagaBulkRetry(t *testing.T) {
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
	var releaseWorks atomic.Bool
	bus := sagatest.NewBus(db.Pool, db.Schema)
	bus.Orchestrate(orch)
	bus.Subscribe("reserve", saga.Action(p, func(context.Context, pgx.Tx, order) (struct{}, error) { return struct{}{}, nil }))
	bus.Subscribe("charge", saga.Action(p, func(context.Context, pgx.Tx, order) (struct{}, error) { return struct{}{}, saga.Fail("card declined") }))
	bus.Subscribe("release", saga.Compensation(p, func(context.Context, pgx.Tx, order) error {
		if !releaseWorks.Load() {
			return saga.Retry(errors.New("stock service unavailable"))
		}
		return nil
	}))
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	const n = 20
	for i := range n {
		id := fmt.Sprintf("o-%02d", i)
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			_, err := saga.StartTx(ctx, tx, def, order{ID: id}, saga.WithID(id), saga.WithWriter(w))
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	count := func(state saga.State) int {
		var c int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Table("saga")+` WHERE state = $1`, string(state)).Scan(&c); err != nil {
			t.Fatal(err)
		}
		return c
	}
	if err := bus.RunUntil(ctx, func() bool { return count(saga.StateStuck) == n }); err != nil {
		t.Fatal(err)
	}

	r := runCmd(ctx, env, "saga", "retry", "--state", "stuck", "--dry-run").expect(t, "saga retry --dry-run", 0)
	if !strings.Contains(r.stdout, "20 sagas would get a retry request (dry run: nothing filed)") || strings.Count(r.stdout, "  o-") != n {
		t.Fatalf("dry run:\n%s", r.stdout)
	}
	var timers int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Table("saga_timer")+` WHERE kind = 'operator'`).Scan(&timers); err != nil || timers != 0 {
		t.Fatalf("the dry run filed %d requests (%v)", timers, err)
	}
	r = runCmd(ctx, env, "saga", "retry", "--state", "stuck", "--limit", "5", "--dry-run").expect(t, "dry run with a limit", 0)
	if !strings.Contains(r.stdout, "5 sagas would get") || !strings.Contains(r.stdout, "more match") {
		t.Errorf("dry run --limit 5:\n%s", r.stdout)
	}
	runCmd(ctx, env, "saga", "retry", "--state", "stuck", "--name", "no-such-saga").expect(t, "retry of nothing", 1)
	runCmd(ctx, env, "saga", "retry", "o-01", "--state", "stuck").expect(t, "an id and filters", 2)

	releaseWorks.Store(true)
	r = runCmd(ctx, env, "saga", "retry", "--state", "stuck").expect(t, "saga retry --state stuck", 0)
	if !strings.Contains(r.stdout, "20 of 20 sagas requested, 0 refused") {
		t.Fatalf("bulk retry:\n%s", r.stdout)
	}
	if err := bus.RunUntil(ctx, func() bool { return count(saga.StateStuck) == 0 && count(saga.StateCompensating) == 0 }); err != nil {
		t.Fatal(err)
	}
	if got := count(saga.StateCompensated) + count(saga.StateCompleted); got != n {
		t.Fatalf("%d of %d sagas finished after the bulk retry", got, n)
	}

	// Refusals are reported saga by saga: none of these is stuck any more.
	r = runCmd(ctx, env, "saga", "compensate", "--name", "checkout").expect(t, "compensate finished sagas", 1)
	if strings.Count(r.stdout, "refused saga o-") != n || !strings.Contains(r.stdout, "only a running saga can be compensated") {
		t.Errorf("bulk compensate of finished sagas:\n%s", r.stdout)
	}
}
