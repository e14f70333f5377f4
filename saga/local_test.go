package saga_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/onceflow/onceflow/saga"
	"github.com/onceflow/onceflow/saga/sagatest"
)

// localDef is a saga of remote and local steps, in the order of names: a name starting with
// "+" is a local step (its action and local compensation record effects, run by w.local and
// w.localComp), any other is the world's remote step of that name. mod adjusts a step.
func localDef(t testing.TB, w **world, names []string, mod func(name string, s *saga.StepDef[Checkout]), opts ...saga.Option) *saga.Definition[Checkout] {
	var steps []*saga.StepDef[Checkout]
	for _, n := range names {
		var s *saga.StepDef[Checkout]
		if name, ok := strings.CutPrefix(n, "+"); ok {
			s = saga.Step[Checkout](name).
				Local(func(ctx context.Context, tx pgx.Tx, c *Checkout) error { return (*w).local(ctx, tx, name, c) }).
				CompensateLocal(func(ctx context.Context, tx pgx.Tx, c *Checkout) error { return (*w).localComp(ctx, tx, name, c) }).
				Attempts(3, 10*time.Millisecond)
		} else {
			s = saga.Step[Checkout](n).
				Send("cmd."+n, func(c Checkout) (any, error) { return stepCmd{Order: c.Order}, nil }).
				Compensate("undo."+n, func(c Checkout) (any, error) { return stepCmd{Order: c.Order}, nil }).
				Attempts(3, 10*time.Millisecond)
		}
		if mod != nil {
			mod(strings.TrimPrefix(n, "+"), s)
		}
		steps = append(steps, s)
	}
	def, err := saga.Define("checkout", 1, steps, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return def
}

// newLocalWorld builds a world over localDef(names); the world's participants serve the
// remote steps.
func newLocalWorld(t *testing.T, batched bool, names []string, mod func(string, *saga.StepDef[Checkout]), opts ...saga.Option) *world {
	t.Helper()
	var w *world
	def := localDef(t, &w, names, mod, opts...)
	w = newWorldMode(t, batched, def)
	if _, err := w.db.Pool.Exec(context.Background(), `CREATE TABLE `+w.db.Schema+`.local_run (seq bigserial PRIMARY KEY, saga text NOT NULL, step text NOT NULL, txid bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return w
}

// local is a local step's action: it records its effect (and the transaction it ran in),
// adds 1 to the amount, then fails as w.fail (saga.Fail) or w.transient (an ordinary error,
// counted down) say; its writes must then be rolled back.
func (w *world) local(ctx context.Context, tx pgx.Tx, name string, c *Checkout) error {
	w.mu.Lock()
	w.calls[name+"/action"]++
	reason, failing := w.fail[name]
	transient := w.transient[name] != 0
	if w.transient[name] > 0 {
		w.transient[name]--
	}
	w.mu.Unlock()
	if _, err := tx.Exec(ctx, `INSERT INTO `+w.db.Schema+`.effect (saga, step, phase) VALUES ($1, $2, 'action')`, c.Order, name); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+w.db.Schema+`.local_run (saga, step, txid) VALUES ($1, $2, txid_current())`, c.Order, name); err != nil {
		return err
	}
	c.Amount++
	switch {
	case failing:
		return saga.Fail(reason)
	case transient:
		return errors.New("ledger row locked by a report")
	}
	return nil
}

// localComp is a local step's compensation; w.compFail makes it fail (counted down; -1: always).
func (w *world) localComp(ctx context.Context, tx pgx.Tx, name string, c *Checkout) error {
	w.mu.Lock()
	w.calls[name+"/compensation"]++
	failing := w.compFail[name] != 0
	if w.compFail[name] > 0 {
		w.compFail[name]--
	}
	w.mu.Unlock()
	if _, err := tx.Exec(ctx, `INSERT INTO `+w.db.Schema+`.effect (saga, step, phase) VALUES ($1, $2, 'compensation')`, c.Order, name); err != nil {
		return err
	}
	if failing {
		return errors.New("ledger offline")
	}
	return nil
}

// txids returns the transactions the local runs of saga committed in, by step.
func (w *world) txids(order string) map[string]int64 {
	w.t.Helper()
	rows, err := w.db.Pool.Query(context.Background(), `SELECT step, txid FROM `+w.db.Schema+`.local_run WHERE saga = $1`, order)
	if err != nil {
		w.t.Fatal(err)
	}
	out := map[string]int64{}
	for rows.Next() {
		var s string
		var x int64
		if err := rows.Scan(&s, &x); err != nil {
			w.t.Fatal(err)
		}
		out[s] = x
	}
	if err := rows.Err(); err != nil {
		w.t.Fatal(err)
	}
	return out
}

func amount(t *testing.T, d *saga.Detail) int {
	t.Helper()
	var c Checkout
	if err := json.Unmarshal(d.Data, &c); err != nil {
		t.Fatal(err)
	}
	return c.Amount
}

// Remote and local steps interleaved: every effect once, in order; the local steps' data
// changes are stored; consecutive local steps (note, mark) run in one transaction.
func TestLocalStepsHappyPath(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		w := newLocalWorld(t, batched, []string{"reserve", "+note", "+mark", "charge", "+confirm"}, nil)
		id := w.start("o-1")
		d := w.runUntil(id, saga.StateCompleted, saga.StateCompensated)
		if d.State != saga.StateCompleted {
			t.Fatalf("state %s (%s)", d.State, d.Error)
		}
		want := []string{"reserve/action", "note/action", "mark/action", "charge/action", "confirm/action"}
		if got := w.effects(id); !slices.Equal(got, want) {
			t.Fatalf("effects %v, want %v", got, want)
		}
		if statuses(d) != "reserve:done note:done mark:done charge:done confirm:done" || len(d.Timers) != 0 {
			t.Fatalf("steps %s, timers %v", statuses(d), d.Timers)
		}
		if a := amount(t, d); a != 42+3 {
			t.Fatalf("amount %d: the local steps' data changes were not kept", a)
		}
		for i, s := range d.Steps {
			local := s.Name == "note" || s.Name == "mark" || s.Name == "confirm"
			if s.Local != local || (local && (s.Attempts != 1 || len(s.Sent) != 0 || s.FinishedAt == nil)) {
				t.Fatalf("step %d: %+v", i, s)
			}
		}
		tx := w.txids(id)
		if tx["note"] != tx["mark"] || tx["note"] == 0 {
			t.Fatalf("consecutive local steps ran in transactions %v, want one", tx)
		}
		if s := w.metrics.Snapshot(); s.LocalRuns != 3 || s.LocalFailures != 0 || s.Completed != 1 {
			t.Fatalf("metrics %+v", s)
		}
	})
}

// saga.Fail in a local step: its own writes roll back, and the steps before it — remote and
// local — are compensated, last first.
func TestLocalStepFailCompensatesInReverse(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		w := newLocalWorld(t, batched, []string{"reserve", "+note", "charge", "+confirm"}, nil)
		w.fail["confirm"] = "order withdrawn"
		id := w.start("o-1")
		d := w.runUntil(id, saga.StateCompleted, saga.StateCompensated)
		if d.State != saga.StateCompensated || !strings.Contains(d.Error, "order withdrawn") {
			t.Fatalf("state %s (%s), want compensated", d.State, d.Error)
		}
		want := []string{"reserve/action", "note/action", "charge/action",
			"charge/compensation", "note/compensation", "reserve/compensation"}
		if got := w.effects(id); !slices.Equal(got, want) {
			t.Fatalf("effects %v, want %v", got, want)
		}
		if statuses(d) != "reserve:compensated note:compensated charge:compensated confirm:failed" {
			t.Fatalf("steps %s", statuses(d))
		}
		if w.calls["confirm/compensation"] != 0 {
			t.Fatal("the failed local step's own compensation ran")
		}
	})
}

// An ordinary error in a local step rolls its writes back, leaves the saga at the step and
// retries it after the backoff; within its attempts it then succeeds, beyond them the saga
// compensates.
func TestLocalStepErrorRetriedThenCompensated(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		errors int
		want   saga.State
	}{{2, saga.StateCompleted}, {5, saga.StateCompensated}} {
		t.Run(fmt.Sprint("errors=", c.errors), func(t *testing.T) {
			t.Parallel()
			forModes(t, func(t *testing.T, batched bool) {
				w := newLocalWorld(t, batched, []string{"reserve", "+note", "charge"}, func(name string, s *saga.StepDef[Checkout]) {
					if name == "note" {
						s.Attempts(3, 50*time.Millisecond)
					}
				})
				w.transient["note"] = c.errors
				id := w.start("o-1")
				// After the first failed run: the saga waits at the step, nothing of the run kept.
				if err := w.bus.RunUntil(context.Background(), func() bool { return w.get(id).Steps[1].Attempts >= 1 }); err != nil {
					t.Fatal(err)
				}
				mid := w.get(id)
				if mid.Step != "note" || mid.State != saga.StateRunning || mid.Steps[1].Status != "running" ||
					!strings.Contains(mid.Steps[1].LastError, "ledger row locked") || len(mid.Timers) != 1 ||
					len(w.effects(id)) != 1 || amount(t, mid) != 42 {
					t.Fatalf("after a failed run: step %s, %s, %+v, timers %v, effects %v, data %s",
						mid.Step, mid.State, mid.Steps[1], mid.Timers, w.effects(id), mid.Data)
				}
				d := w.runUntil(id, saga.StateCompleted, saga.StateCompensated)
				if d.State != c.want {
					t.Fatalf("state %s (%s), want %s", d.State, d.Error, c.want)
				}
				want := []string{"reserve/action", "note/action", "charge/action"}
				if c.want == saga.StateCompensated {
					want = []string{"reserve/action", "reserve/compensation"}
					if !strings.Contains(d.Error, "after 3 attempts") {
						t.Fatalf("error %q", d.Error)
					}
				}
				if got := w.effects(id); !slices.Equal(got, want) {
					t.Fatalf("effects %v, want %v", got, want)
				}
				if d.Steps[1].Attempts != 3 || w.calls["note/action"] != 3 {
					t.Fatalf("note ran %d times, attempts %d; want 3", w.calls["note/action"], d.Steps[1].Attempts)
				}
				if s := w.metrics.Snapshot(); s.LocalRuns != 3 || s.LocalFailures != int64(min(c.errors, 3)) {
					t.Fatalf("metrics %+v", s)
				}
			})
		})
	}
}

// A local compensation that keeps failing: its writes roll back each time, and the saga is
// stuck after the compensation attempts, for an operator.
func TestLocalCompensationFailingGoesStuck(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		w := newLocalWorld(t, batched, []string{"reserve", "+note", "charge"}, nil,
			saga.WithCompensationAttempts(2, 10*time.Millisecond))
		w.fail["charge"] = "card declined"
		w.compFail["note"] = -1
		id := w.start("o-1")
		d := w.runUntil(id, saga.StateStuck, saga.StateCompensated)
		if d.State != saga.StateStuck || !strings.Contains(d.Error, "ledger offline") {
			t.Fatalf("state %s (%s), want stuck", d.State, d.Error)
		}
		if got, want := w.effects(id), []string{"reserve/action", "note/action"}; !slices.Equal(got, want) {
			t.Fatalf("effects %v, want %v: a failed local compensation's writes were kept", got, want)
		}
		if d.Steps[1].CompAttempts != 2 || w.calls["note/compensation"] != 2 {
			t.Fatalf("note's compensation ran %d times, %d attempts; want 2", w.calls["note/compensation"], d.Steps[1].CompAttempts)
		}
		// Fixed, resumed by an operator: the compensation runs again, then reserve's.
		w.mu.Lock()
		w.compFail["note"] = 0
		w.mu.Unlock()
		if err := pgx.BeginFunc(context.Background(), w.db.Pool, func(tx pgx.Tx) error {
			return w.admin().RetryTx(context.Background(), tx, id)
		}); err != nil {
			t.Fatal(err)
		}
		w.runUntil(id, saga.StateCompensated)
		if got, want := w.effects(id), []string{"reserve/action", "note/action", "note/compensation", "reserve/compensation"}; !slices.Equal(got, want) {
			t.Fatalf("effects %v, want %v", got, want)
		}
	})
}

// Terminal hooks run in the final transition's transaction; a saga that is all local
// completes in StartTx's transaction with RunLocalSteps.
func TestLocalFirstStepInStartTx(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		w := newLocalWorld(t, batched, []string{"+place", "reserve", "+confirm"}, nil)
		var startTx int64
		err := pgx.BeginFunc(context.Background(), w.db.Pool, func(tx pgx.Tx) error {
			if err := tx.QueryRow(context.Background(), `SELECT txid_current()`).Scan(&startTx); err != nil {
				return err
			}
			_, err := saga.StartTx(context.Background(), tx, w.def, Checkout{Order: "o-1", Amount: 42},
				saga.WithID("o-1"), saga.WithWriter(w.writer()), saga.RunLocalSteps())
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		d := w.get("o-1")
		if tx := w.txids("o-1"); tx["place"] != startTx {
			t.Fatalf("place ran in transaction %d, the start was %d", tx["place"], startTx)
		}
		if statuses(d) != "place:done reserve:running confirm:pending" || amount(t, d) != 43 || d.Steps[1].Attempts != 1 {
			t.Fatalf("after the start: %s, %s", statuses(d), d.Data)
		}
		d = w.runUntil("o-1", saga.StateCompleted, saga.StateCompensated)
		if got, want := w.effects("o-1"), []string{"place/action", "reserve/action", "confirm/action"}; d.State != saga.StateCompleted || !slices.Equal(got, want) {
			t.Fatalf("%s: effects %v, want %v", d.State, got, want)
		}
	})
}

// Without RunLocalSteps, a local first step runs after the start commits, when Run fires its
// timer: within about TimerInterval.
func TestLocalFirstStepAfterStart(t *testing.T) {
	t.Parallel()
	w := newLocalWorld(t, false, []string{"+place", "reserve"}, nil)
	id := w.start("o-1")
	d := w.get(id)
	if statuses(d) != "place:pending reserve:pending" || len(d.Timers) != 1 || len(w.effects(id)) != 0 {
		t.Fatalf("after the start: %s, timers %v, effects %v", statuses(d), d.Timers, w.effects(id))
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	started := time.Now()
	go func() { done <- w.orch.Run(ctx) }()
	for w.get(id).Steps[0].Status != "done" {
		if time.Since(started) > 5*time.Second {
			t.Fatalf("the local first step did not run: %+v", w.get(id).Steps[0])
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	// TimerInterval is 20ms here; a generous bound for a loaded machine.
	if took := time.Since(started); took > 2*time.Second {
		t.Fatalf("the local first step ran %s after the start", took)
	}
	if got := w.effects(id); !slices.Equal(got, []string{"place/action"}) {
		t.Fatalf("effects %v", got)
	}
	d = w.runUntil(id, saga.StateCompleted)
	if d.Steps[0].Attempts != 1 {
		t.Fatalf("place: %+v", d.Steps[0])
	}
}

// OnCompleted and OnCompensated run in the final transition's transaction.
func TestTerminalHooks(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		var w *world
		hook := func(state string) func(context.Context, pgx.Tx, *Checkout) error {
			return func(ctx context.Context, tx pgx.Tx, c *Checkout) error {
				_, err := tx.Exec(ctx, `INSERT INTO `+w.db.Schema+`.effect (saga, step, phase) VALUES ($1, 'order', $2)`, c.Order, state)
				return err
			}
		}
		def := localDef(t, &w, []string{"reserve", "charge"}, nil,
			saga.OnCompleted(hook("confirmed")), saga.OnCompensated(hook("cancelled")))
		w = newWorldMode(t, batched, def)
		w.failOrder["o-2"] = "charge"
		ok, failed := w.start("o-1"), w.start("o-2")
		w.runUntil(ok, saga.StateCompleted)
		w.runUntil(failed, saga.StateCompensated)
		if got := w.effects(ok); !slices.Equal(got, []string{"reserve/action", "charge/action", "order/confirmed"}) {
			t.Fatalf("effects %v", got)
		}
		if got := w.effects(failed); !slices.Equal(got, []string{"reserve/action", "reserve/compensation", "order/cancelled"}) {
			t.Fatalf("effects %v", got)
		}
	})
}

// Replies delivered twice, at once, to two orchestrators: each local step runs once.
func TestLocalStepsConcurrentDuplicates(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		w := newLocalWorld(t, batched, []string{"reserve", "+note", "charge", "+confirm"}, nil)
		w.orchestrate(w.newOrchestrator())
		for _, name := range []string{"reserve", "charge"} {
			w.subscribeParticipant(name, true)
		}
		w.bus.DeliverTwice, w.bus.Concurrent = true, true
		var ids []string
		for i := range 10 {
			ids = append(ids, w.start(fmt.Sprintf("o-%d", i)))
		}
		want := []string{"reserve/action", "note/action", "charge/action", "confirm/action"}
		for _, id := range ids {
			d := w.runUntil(id, saga.StateCompleted, saga.StateCompensated)
			if d.State != saga.StateCompleted || !slices.Equal(w.effects(id), want) || amount(t, d) != 44 {
				t.Fatalf("saga %s: %s with effects %v, data %s", id, d.State, w.effects(id), d.Data)
			}
		}
	})
}

func TestLocalStepDefinitionChecks(t *testing.T) {
	t.Parallel()
	fn := func(context.Context, pgx.Tx, *Checkout) error { return nil }
	build := func(Checkout) (any, error) { return nil, nil }
	for _, c := range []struct {
		step *saga.StepDef[Checkout]
		want string
	}{
		{saga.Step[Checkout]("a").Local(fn).Send("t", build), "both Local and Send"},
		{saga.Step[Checkout]("a").Local(fn).Timeout(time.Second), "Timeout on a local step"},
		{saga.Step[Checkout]("a").Local(fn).OnReply(func(*Checkout, saga.Reply) error { return nil }), "OnReply on a local step"},
		{saga.Step[Checkout]("a").Send("t", build).Compensate("u", build).CompensateLocal(fn), "both Compensate and CompensateLocal"},
		{saga.Step[Checkout]("a").Local(fn).CompensateLocal(fn).Pivot(), "Compensate is not allowed"},
	} {
		_, err := saga.Define("x", 1, []*saga.StepDef[Checkout]{c.step})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("got %v, want %q", err, c.want)
		}
	}
	_, err := saga.Define("x", 1, []*saga.StepDef[Checkout]{saga.Step[Checkout]("a").Local(fn)},
		saga.OnCompleted(func(context.Context, pgx.Tx, *stepCmd) error { return nil }))
	if err == nil || !strings.Contains(err.Error(), "OnCompleted hook") {
		t.Errorf("a hook of another data type: %v", err)
	}
}

// The transition that runs local steps notes each run on its span.
func TestLocalStepsInTransitionSpan(t *testing.T) {
	t.Parallel()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	w := newLocalWorld(t, false, []string{"reserve", "+note", "+confirm"}, nil)
	o, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: w.db.Pool, Schema: w.db.Schema, TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	if err := saga.Register(o, w.def); err != nil {
		t.Fatal(err)
	}
	w.bus = sagatest.NewBus(w.db.Pool, w.db.Schema)
	w.bus.Orchestrate(o)
	w.subscribeParticipant("reserve", true)
	id := w.start("o-1")
	if d := w.runUntil(id, saga.StateCompleted, saga.StateCompensated); d.State != saga.StateCompleted {
		t.Fatalf("state %s (%s)", d.State, d.Error)
	}
	var events []string
	for _, s := range exp.GetSpans() {
		if strings.HasPrefix(s.Name, "process") {
			for _, e := range s.Events {
				events = append(events, e.Name)
			}
		}
	}
	if want := []string{"saga local step note: action done", "saga local step confirm: action done"}; !slices.Equal(events, want) {
		t.Fatalf("span events %v, want %v", events, want)
	}
}

// StartSQLTx cannot hand a local step a pgx.Tx: even with RunLocalSteps, a local first step
// runs after the start, and the saga completes.
func TestLocalFirstStepStartSQLTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newLocalWorld(t, false, []string{"+place", "reserve"}, nil)
	db := stdlib.OpenDBFromPool(w.db.Pool)
	defer db.Close()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := saga.StartSQLTx(ctx, tx, w.def, Checkout{Order: "o-1", Amount: 42}, saga.WithID("o-1"), saga.WithWriter(w.writer()), saga.RunLocalSteps()); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if d := w.get("o-1"); d.Steps[0].Status != "pending" || d.Wait == nil || d.Wait.For != saga.WaitRun {
		t.Fatalf("after the start: %s, wait %+v", statuses(d), d.Wait)
	}
	d := w.runUntil("o-1", saga.StateCompleted, saga.StateCompensated)
	if got := w.effects("o-1"); d.State != saga.StateCompleted || !slices.Equal(got, []string{"place/action", "reserve/action"}) {
		t.Fatalf("%s, effects %v", d.State, got)
	}
}

// A transition that ran a local step and then failed (here its OnCompleted hook) commits
// nothing: not the step's writes, not the saga's state. Tried again, the step runs again and
// its effect commits once.
func TestLocalStepCommitsWithTheTransitionOrNot(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		var w *world
		hookFails := 2
		def := localDef(t, &w, []string{"reserve", "+confirm"}, nil,
			saga.OnCompleted(func(ctx context.Context, tx pgx.Tx, c *Checkout) error {
				w.mu.Lock()
				defer w.mu.Unlock()
				if hookFails > 0 {
					hookFails--
					return errors.New("orders table locked")
				}
				return nil
			}))
		w = newWorldMode(t, batched, def)
		if _, err := w.db.Pool.Exec(context.Background(), `CREATE TABLE `+w.db.Schema+`.local_run (seq bigserial PRIMARY KEY, saga text NOT NULL, step text NOT NULL, txid bigint NOT NULL)`); err != nil {
			t.Fatal(err)
		}
		id := w.start("o-1")
		// The bus returns a batch's error (a batched consumer would retry it): deliver again. The
		// failed transition left the saga where the reply found it, at reserve.
		var d *saga.Detail
		for tries := 0; ; tries++ {
			err := w.bus.RunUntil(context.Background(), func() bool { d = w.get(id); return d.State == saga.StateCompleted })
			if err == nil {
				break
			}
			if tries == 5 {
				t.Fatal(err)
			}
			d = w.get(id)
			if d.State != saga.StateRunning || d.Step != "reserve" || len(w.effects(id)) != 1 || amount(t, d) != 42 {
				t.Fatalf("after a failed transition: %s at %s, effects %v, data %s", d.State, d.Step, w.effects(id), d.Data)
			}
		}
		if got, want := w.effects(id), []string{"reserve/action", "confirm/action"}; !slices.Equal(got, want) || w.calls["confirm/action"] != 3 {
			t.Fatalf("effects %v, want %v; confirm ran %d times, want 3", got, want, w.calls["confirm/action"])
		}
		if d.Steps[1].Attempts != 1 || amount(t, d) != 43 {
			t.Fatalf("confirm %+v, data %s: the failed transitions left a trace", d.Steps[1], d.Data)
		}
	})
}

// Replies of many sagas in one batch, each reaching local steps (one savepoint per local run):
// the orchestrator applies the batch in several transactions, so none takes more than 60
// savepoints (PostgreSQL's subtransaction cache overflows beyond 64).
func TestLocalStepsInLargeBatchesStayUnderTheSavepointCap(t *testing.T) {
	t.Parallel()
	w := newLocalWorld(t, true, []string{"reserve", "+note", "+mark", "charge", "+confirm"}, nil)
	var ids []string
	for i := range 70 {
		ids = append(ids, w.start(fmt.Sprintf("o-%02d", i)))
	}
	for _, id := range ids {
		if d := w.runUntil(id, saga.StateCompleted, saga.StateCompensated); d.State != saga.StateCompleted {
			t.Fatalf("saga %s: %s (%s)", id, d.State, d.Error)
		}
	}
	// Three local steps per definition: at most 20 transitions, 60 local runs, per transaction.
	var most, txs int
	if err := w.db.Pool.QueryRow(context.Background(), `SELECT max(n), count(*) FROM (SELECT count(*) AS n FROM `+w.db.Schema+
		`.local_run GROUP BY txid) t`).Scan(&most, &txs); err != nil {
		t.Fatal(err)
	}
	if most > 60 {
		t.Fatalf("a transaction ran %d local steps (savepoints), over 60", most)
	}
	if txs < 2*4 { // note+mark after reserve, confirm after charge: 70 sagas, chunks of 20 each time
		t.Fatalf("%d transactions ran local steps; want the batches of 70 replies split", txs)
	}
}
