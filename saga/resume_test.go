package saga_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

// A saga stuck moving forward — its last reply could not be applied because the completion
// hook kept failing — resumes forward with `saga retry` once the hook is fixed: the step's
// command is re-sent as a new attempt, the participant answers it with the result its action
// kept (the action does not run again), and the saga completes. At a compensable step it used
// to be compensated (both steps undone although the step said done); at a pivot step the
// timer loop panicked on the missing compensation.
func TestRetryResumesAForwardStuckSaga(t *testing.T) {
	t.Parallel()
	for _, pivot := range []bool{false, true} {
		name := "compensable step"
		if pivot {
			name = "pivot step"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var hookFails atomic.Bool
			hookFails.Store(true)
			hook := saga.OnCompleted(func(context.Context, pgx.Tx, *Checkout) error {
				if hookFails.Load() {
					return errors.New("orders table locked")
				}
				return nil
			})
			def := checkoutDef(t, nil, hook)
			want := []string{"reserve/action", "charge/action", "confirm/action"}
			if pivot {
				steps := []*saga.StepDef[Checkout]{
					saga.Step[Checkout]("reserve").Send("cmd.reserve", cmdOf).Compensate("undo.reserve", cmdOf),
					saga.Step[Checkout]("charge").Send("cmd.charge", cmdOf).Pivot(),
				}
				var err error
				if def, err = saga.Define("checkout", 1, steps, hook); err != nil {
					t.Fatal(err)
				}
				want = want[:2]
			}
			w := newWorld(t, def)
			id := w.start("o-1")
			d := w.runUntil(id, saga.StateStuck, saga.StateCompleted, saga.StateCompensated)
			if d.State != saga.StateStuck || !strings.Contains(d.Error, "orders table locked") {
				t.Fatalf("saga %s (%q), want stuck by the hook", d.State, d.Error)
			}
			hookFails.Store(false)
			if err := pgx.BeginFunc(context.Background(), w.db.Pool, func(tx pgx.Tx) error { return w.admin().RetryTx(context.Background(), tx, id) }); err != nil {
				t.Fatal(err)
			}
			if _, err := w.orch.FireDue(context.Background()); err != nil { // the retry request, due at once
				t.Fatal(err)
			}
			d = w.runUntil(id, saga.StateCompleted, saga.StateCompensated, saga.StateStuck)
			if got := w.effects(id); d.State != saga.StateCompleted || !slices.Equal(got, want) {
				t.Fatalf("after retry: saga %s (%q), effects %v, want completed with %v", d.State, d.Error, got, want)
			}
			last := d.Steps[len(d.Steps)-1]
			w.mu.Lock()
			calls := w.calls[last.Name+"/action"]
			w.mu.Unlock()
			if last.Attempts != 2 || calls != 1 {
				t.Fatalf("last step: %d attempts sent (want 2), handler ran %d times (want 1)", last.Attempts, calls)
			}
		})
	}
}

func cmdOf(c Checkout) (any, error) { return stepCmd{Order: c.Order}, nil }

// A definition's code that panics in a timer's transition (here the command builder of a
// re-send) does not take the orchestrator down: the saga is set stuck with the panic, the
// timer is gone, and the other sagas go on.
func TestTimerPanicSetsTheSagaStuck(t *testing.T) {
	t.Parallel()
	var panicking atomic.Bool
	def := checkoutDef(t, func(name string, s *saga.StepDef[Checkout]) {
		if name == "reserve" {
			s.Send("cmd.reserve", func(c Checkout) (any, error) {
				if panicking.Load() && c.Order == "o-bad" {
					panic("nil map in the command builder")
				}
				return stepCmd{Order: c.Order}, nil
			}).Timeout(200 * time.Millisecond)
		}
	})
	w := newWorld(t, def, "reserve")
	bad := w.start("o-bad")
	panicking.Store(true)
	w.waitPending("cmd.reserve", 1)
	deadline := time.Now().Add(30 * time.Second)
	for w.get(bad).State != saga.StateStuck {
		if time.Now().After(deadline) {
			t.Fatalf("saga %+v not stuck", w.get(bad))
		}
		if _, err := w.orch.FireDue(context.Background()); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	d := w.get(bad)
	if !strings.Contains(d.Error, "panic") || !strings.Contains(d.Error, "nil map in the command builder") {
		t.Fatalf("stuck with %q, want the panic", d.Error)
	}
	if n := w.count(`SELECT count(*) FROM `+w.db.Schema+`.saga_timer WHERE saga_id = $1 AND kind = 'step'`, bad); n != 0 {
		t.Fatalf("%d step timers left for the stuck saga", n)
	}
	w.subscribeAction("reserve", nil)
	ok := w.start("o-ok")
	if d := w.runUntil(ok, saga.StateCompleted, saga.StateCompensated); d.State != saga.StateCompleted {
		t.Fatalf("another saga: %s (%q)", d.State, d.Error)
	}
}

// A reply whose last attempt's commit went through as the connection dropped is applied, and
// its redelivery is a duplicate: settling it as poison afterwards (what the consumer does when
// the attempts of that delivery ran out) changes nothing — no poison row, and the saga is not
// stuck.
func TestSettlingAnAppliedReplyLeavesTheSagaAlone(t *testing.T) {
	t.Parallel()
	w := newWorld(t, checkoutDef(t, nil), "reserve")
	id := w.start("o-1")
	reply := outbox.SetSaga(outbox.NewMessage([]byte(`{"id":"r-1"}`)), outbox.SagaRef{ID: id, Step: "reserve", Phase: outbox.SagaPhaseAction, Attempt: 1})
	reply.Metadata.Set(outbox.MetadataSagaName, "checkout")
	reply.Metadata.Set(outbox.MetadataSagaOutcome, outbox.SagaOutcomeDone)
	if err := w.orch.Handler(reply); err != nil {
		t.Fatal(err)
	}
	if d := w.get(id); d.State != saga.StateRunning || d.Step != "charge" {
		t.Fatalf("after the reply: %s at %s", d.State, d.Step)
	}
	if err := w.orch.SettlePoison(context.Background(), reply, inbox.GiveUp{Attempts: 5, Err: errors.New("saga: commit: conn closed")}); err != nil {
		t.Fatal(err)
	}
	if d := w.get(id); d.State != saga.StateRunning || d.Step != "charge" || d.Error != "" {
		t.Fatalf("after settling the applied reply: %s at %s (%q), want still running at charge", d.State, d.Step, d.Error)
	}
	if n := w.count(`SELECT count(*) FROM ` + w.db.Schema + `.inbox_poison`); n != 0 {
		t.Fatalf("%d poison rows for a reply that was applied", n)
	}
}

// A saga at its pivot step is refused a compensation up front, by an Admin that does not know
// its definition (the CLI's): the pivot is recorded in the saga's history when it starts.
func TestCompensatePastThePivotRefusedWithoutTheDefinition(t *testing.T) {
	t.Parallel()
	steps := []*saga.StepDef[Checkout]{
		saga.Step[Checkout]("reserve").Send("cmd.reserve", cmdOf).Compensate("undo.reserve", cmdOf),
		saga.Step[Checkout]("charge").Send("cmd.charge", cmdOf).Pivot(),
	}
	def, err := saga.Define("checkout", 1, steps)
	if err != nil {
		t.Fatal(err)
	}
	w := newWorld(t, def, "charge")
	ctx := context.Background()
	late := w.start("o-late")
	if err := w.bus.RunUntil(ctx, func() bool { return w.get(late).Step == "charge" }); err != nil {
		t.Fatal(err)
	}
	early := w.start("o-early") // still at reserve: before the pivot
	admin := w.admin()          // no definitions, as the CLI's
	compensate := func(id string) error {
		return pgx.BeginFunc(ctx, w.db.Pool, func(tx pgx.Tx) error { return admin.CompensateTx(ctx, tx, id) })
	}
	err = compensate(late)
	if !errors.Is(err, saga.ErrPastPivot) || !strings.Contains(err.Error(), `pivot "charge"`) {
		t.Fatalf("compensate at the pivot: %v, want ErrPastPivot naming the pivot", err)
	}
	for _, tm := range w.get(late).Timers {
		if tm.Kind == "operator" {
			t.Fatalf("a refused request was filed: %+v", tm)
		}
	}
	if d := w.get(late); !d.Steps[1].Pivot || d.Steps[0].Pivot {
		t.Fatalf("pivot not recorded on its step: %+v", d.Steps)
	}
	if err := compensate(early); err != nil {
		t.Fatalf("compensate before the pivot: %v", err)
	}
	if past, known := admin.PastPivot(w.get(early)); past || !known {
		t.Fatalf("PastPivot before the pivot = %v, %v", past, known)
	}
}
