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

type orderV2 struct {
	ID       string `json:"id"`
	Priority string `json:"priority"`
}

// `saga upgrade --dry-run` lists the sagas at a step boundary and the others with the
// reason, and files nothing; without --dry-run it files a request per saga at a boundary,
// which an orchestrator with version 2 carries out; `saga show` prints the upgrade (and a
// refused one, with why), and the upgraded saga finishes on version 2.
func TestSagaUpgradeCommand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	env := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema}
	build := func(o order) (any, error) { return o, nil }
	v1 := saga.MustDefine("checkout", 1, []*saga.StepDef[order]{
		saga.Step[order]("reserve").Send("reserve", build).Compensate("release", build).Attempts(5, time.Hour),
		saga.Step[order]("charge").Send("charge", build),
	})
	build2 := func(o orderV2) (any, error) { return o, nil }
	v2 := saga.MustDefine("checkout", 2, []*saga.StepDef[orderV2]{
		saga.Step[orderV2]("reserve-stock").Send("stock.reserve", build2).Compensate("stock.release", build2),
		saga.Step[orderV2]("charge").Send("payments.charge", build2),
		saga.Step[orderV2]("notify").Send("notify", build2),
	}, saga.Upgrade(1, func(o order) (orderV2, error) {
		if o.ID == "o-3" {
			return orderV2{}, errors.New("order o-3 has no priority class")
		}
		return orderV2{ID: o.ID, Priority: "standard"}, nil
	}, saga.StepMap{"reserve": "reserve-stock"}))
	orch, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: db.Pool, Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(saga.Register(orch, v1), saga.Register(orch, v2)); err != nil {
		t.Fatal(err)
	}
	p, err := saga.NewParticipant(saga.ParticipantConfig{Pool: db.Pool, Schema: db.Schema, Consumer: "svc"})
	if err != nil {
		t.Fatal(err)
	}
	bus := sagatest.NewBus(db.Pool, db.Schema)
	bus.Orchestrate(orch)
	// o-1 and o-3 wait to re-send reserve (a boundary); o-2 waits for charge's reply (no
	// version-1 payments runs).
	bus.Subscribe("reserve", saga.Action(p, func(_ context.Context, _ pgx.Tx, o order) (struct{}, error) {
		if o.ID == "o-2" {
			return struct{}{}, nil
		}
		return struct{}{}, saga.Retry(errors.New("stock service busy"))
	}))
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"o-1", "o-2", "o-3"} {
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			_, err := saga.StartTx(ctx, tx, v1, order{ID: id}, saga.WithID(id), saga.WithWriter(w))
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	count := func(sql string) int {
		var n int
		if err := db.Pool.QueryRow(ctx, sql).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if err := bus.RunUntil(ctx, func() bool {
		return count(`SELECT count(*) FROM `+db.Table("saga")+` WHERE waiting = 'resend' OR step = 1`) == 3
	}); err != nil {
		t.Fatal(err)
	}
	operator := `SELECT count(*) FROM ` + db.Table("saga_timer") + ` WHERE kind = 'operator'`

	r := runCmd(ctx, env, "saga", "upgrade", "--name", "checkout", "--from", "1", "--dry-run").expect(t, "saga upgrade --dry-run", 0)
	for _, want := range []string{
		"2 of 3 unfinished sagas of checkout version 1 are at a step boundary and would get an upgrade request to the newest version that declares saga.Upgrade from 1 (dry run: nothing filed)",
		"  o-1 at step reserve\n", "  o-3 at step reserve\n",
		"  o-2: it waits for the reply to step charge (attempt 1): a command is in flight",
		"note: no running orchestrator has the newest version that declares saga.Upgrade from 1 of checkout registered (onceflow saga versions): the requests wait until one runs",
	} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("dry run does not say %q:\n%s", want, r.stdout)
		}
	}
	if n := count(operator); n != 0 {
		t.Fatalf("the dry run filed %d requests", n)
	}
	runCmd(ctx, env, "saga", "upgrade", "--from", "1").expect(t, "no --name", 2)
	runCmd(ctx, env, "saga", "upgrade", "--name", "checkout", "--from", "2", "--to", "1").expect(t, "--to before --from", 2)
	runCmd(ctx, env, "saga", "upgrade", "o-1", "--name", "checkout", "--from", "1").expect(t, "an id", 2)
	if r := runCmd(ctx, env, "saga", "upgrade", "-h").expect(t, "saga upgrade -h", 0); !strings.Contains(r.stdout, "step boundary") {
		t.Errorf("saga upgrade -h:\n%s", r.stdout)
	}
	if r := runCmd(ctx, env, "saga", "-h").expect(t, "saga -h", 0); !strings.Contains(r.stdout, "upgrade --name N --from V") {
		t.Errorf("saga -h does not list upgrade:\n%s", r.stdout)
	}
	if r := runCmd(ctx, env, "saga", "upgrade", "--name", "refund", "--from", "1").expect(t, "nothing to upgrade", 1); !strings.Contains(r.stderr, "no unfinished saga of refund version 1") {
		t.Errorf("nothing to upgrade:\n%s", r.stderr)
	}

	// A live orchestrator of the new deploy has version 2: no note.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("saga_orchestrator")+` (id, consumer, host, pid, definitions, expires_at)
		VALUES ('new-1', 'onceflow-saga', 'web-1', 1, '[{"name": "checkout", "version": 2}]', now() + interval '1 minute')`); err != nil {
		t.Fatal(err)
	}
	r = runCmd(ctx, env, "saga", "upgrade", "--name", "checkout", "--from", "1", "--to", "2").expect(t, "saga upgrade", 1)
	if strings.Contains(r.stdout, "note: no running orchestrator") {
		t.Errorf("the upgrade notes a missing orchestrator, though one with version 2 runs:\n%s", r.stdout)
	}
	for _, want := range []string{
		"upgrade requested for saga o-1 (at step reserve)", "upgrade requested for saga o-3 (at step reserve)",
		"refused saga o-2: it waits for the reply to step charge",
		"2 of 3 sagas requested, 1 refused; an orchestrator that has version 2 (declaring saga.Upgrade from 1) of checkout carries the requests out",
	} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("upgrade does not say %q:\n%s", want, r.stdout)
		}
	}
	if !strings.Contains(r.stderr, "1 sagas refused (listed above)") {
		t.Errorf("upgrade stderr:\n%s", r.stderr)
	}
	if n := count(operator); n != 2 {
		t.Fatalf("%d requests filed, want 2", n)
	}
	if _, err := orch.FireDue(ctx); err != nil { // the requests, due at once
		t.Fatal(err)
	}

	r = runCmd(ctx, env, "saga", "show", "o-1").expect(t, "saga show o-1", 0)
	for _, want := range []string{
		"saga o-1: checkout v2, running at step reserve-stock",
		"upgraded from version 1 to 2 at ", ", step reserve → reserve-stock\n",
		"  steps: reserve → reserve-stock (running); charge (pending); + notify (new)\n",
		"(sent as reserve)", `"priority":"standard"`,
	} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("saga show o-1 does not say %q:\n%s", want, r.stdout)
		}
	}
	r = runCmd(ctx, env, "saga", "show", "o-3").expect(t, "saga show o-3", 0)
	if !strings.Contains(r.stdout, "saga o-3: checkout v1") || !strings.Contains(r.stdout,
		"upgrade from version 1 to version 2 refused at ") || !strings.Contains(r.stdout, "(at step reserve): its data does not convert to version 2: order o-3 has no priority class") {
		t.Errorf("saga show o-3:\n%s", r.stdout)
	}

	// Version 2's participants: o-1 re-sends reserve to stock.reserve and completes on version 2.
	ok := saga.Action(p, func(context.Context, pgx.Tx, orderV2) (struct{}, error) { return struct{}{}, nil })
	for _, topic := range []string{"stock.reserve", "payments.charge", "notify"} {
		bus.Subscribe(topic, ok)
	}
	admin, err := saga.NewAdmin(db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	if err := bus.RunUntil(ctx, func() bool {
		d, err := admin.Get(ctx, db.Pool, "o-1")
		return err == nil && d.State == saga.StateCompleted
	}); err != nil {
		t.Fatal(err)
	}
}
