package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
	"github.com/onceflow/onceflow/saga/sagatest"
	"github.com/onceflow/onceflow/status"
)

// A reply of a version-2 saga reached an orchestrator that has only version 1 and was parked:
// `saga show` says the saga awaits an orchestrator with checkout version 2 and what to do;
// `status` counts the parked replies per version, and is stuck once one waits longer than
// --max-version-wait.
func TestSagaAwaitingVersionCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	env := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema}
	build := func(o order) (any, error) { return o, nil }
	steps := []*saga.StepDef[order]{saga.Step[order]("reserve").Send("reserve", build)}
	v1, v2 := saga.MustDefine("checkout", 1, steps), saga.MustDefine("checkout", 2, steps)
	orch, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: db.Pool, Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := saga.Register(orch, v1); err != nil {
		t.Fatal(err)
	}
	p, err := saga.NewParticipant(saga.ParticipantConfig{Pool: db.Pool, Schema: db.Schema, Consumer: "svc"})
	if err != nil {
		t.Fatal(err)
	}
	bus := sagatest.NewBus(db.Pool, db.Schema)
	bus.Orchestrate(orch)
	bus.Subscribe("reserve", saga.Action(p, func(context.Context, pgx.Tx, order) (struct{}, error) { return struct{}{}, nil }))
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := saga.StartTx(ctx, tx, v2, order{ID: "o-2"}, saga.WithID("o-2"), saga.WithWriter(w))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	parked := func() bool {
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Table("saga_parked")).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	}
	if err := bus.RunUntil(ctx, parked); err != nil {
		t.Fatal(err)
	}

	r := runCmd(ctx, env, "saga", "show", "o-2").expect(t, "saga show", 0)
	if !strings.Contains(r.stdout, "waiting for: an orchestrator with definition checkout version 2: 1 reply of this saga") ||
		!strings.Contains(r.stdout, "registers checkout version 2 (saga.Register)") {
		t.Errorf("saga show of a saga with a parked reply:\n%s", r.stdout)
	}
	r = runCmd(ctx, env, "status").expect(t, "status with a fresh parked reply", 0)
	row := ""
	for _, line := range strings.Split(r.stdout, "\n") {
		if strings.HasPrefix(line, "checkout v2 ") {
			row = strings.Join(strings.Fields(line), " ")
		}
	}
	if !strings.Contains(r.stdout, "AWAITING VERSION") || !strings.HasPrefix(row, "checkout v2 1 1 ") {
		t.Errorf("status with a parked reply:\n%s", r.stdout)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE `+db.Table("saga_parked")+` SET parked_at = now() - interval '10 minutes'`); err != nil {
		t.Fatal(err)
	}
	r = runCmd(ctx, env, "status", "--json").expect(t, "status with a reply parked for 10 minutes", exitStuck)
	var rep status.Report
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil {
		t.Fatalf("%v\n%s", err, r.stdout)
	}
	if len(rep.AwaitingVersion) != 1 || rep.AwaitingVersion[0].Version != 2 || rep.AwaitingVersion[0].Replies != 1 || rep.AwaitingVersion[0].OldestAgeSeconds < 599 {
		t.Errorf("awaiting_version %+v; want 1 reply of checkout v2, 10 minutes old", rep.AwaitingVersion)
	}
	if !strings.Contains(strings.Join(rep.Problems, "\n"), "no running orchestrator has checkout version 2 registered") {
		t.Errorf("problems %q; want the parked reply's", rep.Problems)
	}
	runCmd(ctx, env, "status", "--max-version-wait", "0").expect(t, "status with the version check off", 0)
}
