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

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

func TestHappyPath(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		w := newWorldMode(t, batched, checkoutDef(t, nil))
		id := w.start("o-1")
		d := w.runUntil(id, saga.StateCompleted, saga.StateCompensated)
		if d.State != saga.StateCompleted {
			t.Fatalf("state %s (%s), want completed", d.State, d.Error)
		}
		if got, want := w.effects(id), []string{"reserve/action", "charge/action", "confirm/action"}; !slices.Equal(got, want) {
			t.Fatalf("effects %v, want %v", got, want)
		}
		var data Checkout
		if err := json.Unmarshal(d.Data, &data); err != nil || data.ReservationID != "reserve-o-1" || data.PaymentID != "charge-o-1" {
			t.Fatalf("OnReply did not update the data: %s (%v)", d.Data, err)
		}
		if statuses(d) != "reserve:done charge:done confirm:done" || len(d.Timers) != 0 {
			t.Fatalf("steps %s, timers %v", statuses(d), d.Timers)
		}
		if s := w.metrics.Snapshot(); s.Started != 1 || s.Completed != 1 || s.Compensated != 0 {
			t.Fatalf("metrics %+v", s)
		}
	})
}

// A business failure at each step in turn: exactly the steps that took effect are
// compensated, last first, and the failing step's own effect was rolled back.
func TestBusinessFailureCompensatesCompletedSteps(t *testing.T) {
	t.Parallel()
	for failAt, name := range stepNames {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			w := newWorld(t, checkoutDef(t, nil))
			w.fail[name] = "declined"
			id := w.start("o-" + name)
			d := w.runUntil(id, saga.StateCompleted, saga.StateCompensated)
			if d.State != saga.StateCompensated || !strings.Contains(d.Error, "declined") {
				t.Fatalf("state %s error %q, want compensated because declined", d.State, d.Error)
			}
			var want []string
			for _, s := range stepNames[:failAt] {
				want = append(want, s+"/action")
			}
			for i := failAt - 1; i >= 0; i-- {
				want = append(want, stepNames[i]+"/compensation")
			}
			if got := w.effects(id); !slices.Equal(got, want) {
				t.Fatalf("effects %v, want %v", got, want)
			}
			if w.calls[name+"/compensation"] != 0 {
				t.Fatalf("the failed step's compensation handler ran")
			}
		})
	}
}

// Every command and reply delivered twice: each effect once, and the same end state as
// without duplicates.
func TestDuplicatesChangeNothing(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ failing, batched bool }{{false, false}, {true, false}, {false, true}, {true, true}} {
		failing := c.failing
		t.Run(fmt.Sprint("failing=", failing, ",batched=", c.batched), func(t *testing.T) {
			t.Parallel()
			run := func(twice bool) (*saga.Detail, []string, *world) {
				w := newWorldMode(t, c.batched, checkoutDef(t, nil))
				w.bus.DeliverTwice = twice
				if failing {
					w.fail["confirm"] = "out of stock"
				}
				id := w.start("o-1")
				return w.runUntil(id, saga.StateCompleted, saga.StateCompensated), w.effects(id), w
			}
			once, onceFx, _ := run(false)
			twice, twiceFx, w := run(true)
			if once.State != twice.State || statuses(once) != statuses(twice) || string(once.Data) != string(twice.Data) {
				t.Fatalf("with duplicates: %s %s %s; without: %s %s %s", twice.State, statuses(twice), twice.Data, once.State, statuses(once), once.Data)
			}
			if replied(once) != replied(twice) {
				t.Fatalf("replies applied with duplicates %q, without %q", replied(twice), replied(once))
			}
			if !slices.Equal(onceFx, twiceFx) {
				t.Fatalf("effects with duplicates %v, without %v", twiceFx, onceFx)
			}
			if w.bus.Delivered == 0 || w.metrics.Snapshot().Started != 1 {
				t.Fatalf("bus delivered %d, metrics %+v", w.bus.Delivered, w.metrics.Snapshot())
			}
		})
	}
}

// Every command and reply delivered twice, at the same time, to two orchestrator instances
// and two instances of each participant: each effect once, and the end state of a run
// without duplicates.
//
// Batched, the copies are two batches of the same replies (and commands) at once: the two
// orchestrators lock the same saga rows in one statement each, in id order, so they wait for
// each other and never deadlock.
func TestConcurrentDuplicatesToTwoOrchestrators(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		failAt  string
		batched bool
	}{{"", false}, {"confirm", false}, {"", true}, {"confirm", true}} {
		failAt := c.failAt
		t.Run(fmt.Sprint("fail=", failAt, ",batched=", c.batched), func(t *testing.T) {
			t.Parallel()
			w := newWorldMode(t, c.batched, checkoutDef(t, nil))
			w.orchestrate(w.newOrchestrator()) // a second instance, on its own pool
			for _, name := range stepNames {   // a second instance of every participant
				w.subscribeParticipant(name, true)
			}
			w.bus.DeliverTwice, w.bus.Concurrent = true, true
			var ids []string
			n := 5
			if c.batched {
				n = 40 // batches of many sagas, locked by both orchestrators at once
			}
			for i := range n {
				order := fmt.Sprintf("o-%d", i)
				if failAt != "" {
					w.failOrder[order] = failAt
				}
				ids = append(ids, w.start(order))
			}
			want, state := []string{"reserve/action", "charge/action", "confirm/action"}, saga.StateCompleted
			if failAt != "" {
				want, state = []string{"reserve/action", "charge/action", "charge/compensation", "reserve/compensation"}, saga.StateCompensated
			}
			for _, id := range ids {
				d := w.runUntil(id, saga.StateCompleted, saga.StateCompensated)
				if d.State != state || !slices.Equal(w.effects(id), want) {
					t.Fatalf("saga %s: %s with effects %v, want %s with %v", id, d.State, w.effects(id), state, want)
				}
			}
			if s := w.metrics.Snapshot(); s.Duplicates == 0 {
				t.Fatalf("metrics %+v: no duplicate reached a barrier", s)
			}
		})
	}
}

// A step that fails transiently twice and then succeeds: attempts 2 and 3 are sent (and run:
// a deliberate re-send is not swallowed as a duplicate), the saga completes, and the failed
// attempts' writes are rolled back.
func TestRetryBeforeCompensate(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		w := newWorldMode(t, batched, checkoutDef(t, nil))
		w.transient["charge"] = 2
		id := w.start("o-1")
		d := w.runUntil(id, saga.StateCompleted, saga.StateCompensated)
		if d.State != saga.StateCompleted {
			t.Fatalf("state %s (%s)", d.State, d.Error)
		}
		charge := d.Steps[1]
		if charge.Attempts != 3 || w.calls["charge/action"] != 3 || len(charge.Sent) != 3 {
			t.Fatalf("charge attempts %d, handler calls %d, sent %d; want 3 each", charge.Attempts, w.calls["charge/action"], len(charge.Sent))
		}
		if got := w.effects(id); !slices.Equal(got, []string{"reserve/action", "charge/action", "confirm/action"}) {
			t.Fatalf("effects %v: the transient failures' writes were kept", got)
		}
		if got := replied(d); got != "reserve:action/1:done charge:action/1:retry charge:action/2:retry charge:action/3:done confirm:action/1:done" {
			t.Fatalf("replies applied %q", got)
		}
	})
}

// Attempt 1 of a step times out, attempt 2 succeeds, and then attempt 1's reply arrives: it
// changes nothing (acknowledged and counted as ignored).
func TestLateReplyOfEarlierAttempt(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		def := checkoutDef(t, func(name string, s *saga.StepDef[Checkout]) {
			if name == "charge" {
				s.Attempts(3, time.Millisecond).Timeout(150 * time.Millisecond)
			}
		})
		w := newWorldMode(t, batched, def, "charge")
		id := w.start("o-1")
		if err := w.bus.RunUntil(context.Background(), func() bool { return w.get(id).Steps[1].Attempts == 2 }); err != nil {
			t.Fatal(err)
		}
		// Attempt 1 is still somewhere (a slow participant); attempt 2 is handled now.
		w.subscribeAction("charge", func(h message.NoPublishHandlerFunc) message.NoPublishHandlerFunc {
			return func(msg *message.Message) error {
				if msg.Metadata.Get(outbox.MetadataSagaAttempt) == "1" {
					return nil
				}
				return h(msg)
			}
		})
		before := w.runUntil(id, saga.StateCompleted, saga.StateCompensated)
		if before.State != saga.StateCompleted {
			t.Fatalf("state %s (%s)", before.State, before.Error)
		}
		late := outbox.SetSaga(outbox.NewMessage([]byte(`{"id":"late"}`)), outbox.SagaRef{ID: id, Step: "charge", Attempt: 1})
		late.Metadata.Set(outbox.MetadataSagaOutcome, outbox.SagaOutcomeDone)
		late.SetContext(context.Background())
		ignored := w.metrics.Snapshot().Ignored
		if err := w.orch.Handler(late); err != nil {
			t.Fatal(err)
		}
		after := w.get(id)
		if after.State != before.State || string(after.Data) != string(before.Data) || statuses(after) != statuses(before) {
			t.Fatalf("a late reply changed the saga: %s %s", after.State, after.Data)
		}
		if w.metrics.Snapshot().Ignored != ignored+1 {
			t.Fatal("the late reply was not counted as ignored")
		}
		if got := w.effects(id); !slices.Equal(got, []string{"reserve/action", "charge/action", "confirm/action"}) {
			t.Fatalf("effects %v", got)
		}
	})
}

// Transient failures beyond the step's attempts compensate.
func TestAttemptsExhaustedCompensates(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		w := newWorldMode(t, batched, checkoutDef(t, nil))
		w.transient["charge"] = 100
		id := w.start("o-1")
		d := w.runUntil(id, saga.StateCompleted, saga.StateCompensated)
		if d.State != saga.StateCompensated || d.Steps[1].Attempts != 3 || !strings.Contains(d.Error, "after 3 attempts") {
			t.Fatalf("state %s, charge attempts %d, error %q", d.State, d.Steps[1].Attempts, d.Error)
		}
		if got := w.effects(id); !slices.Equal(got, []string{"reserve/action", "reserve/compensation"}) {
			t.Fatalf("effects %v", got)
		}
	})
}

// A compensation that keeps failing makes the saga stuck, visible with its error; an
// operator's retry (once the cause is fixed) resumes it to compensated.
func TestStuckCompensationAndOperatorRetry(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		def := checkoutDef(t, nil, saga.WithCompensationAttempts(2, 5*time.Millisecond))
		w := newWorldMode(t, batched, def)
		w.fail["charge"] = "card declined"
		w.compFail["reserve"] = -1 // fails until changed
		id := w.start("o-1")
		d := w.runUntil(id, saga.StateStuck)
		if !strings.Contains(d.Error, "refund service down") || d.Steps[0].CompAttempts != 2 || d.Steps[0].Status != "compensating" {
			t.Fatalf("stuck saga: error %q, reserve %+v", d.Error, d.Steps[0])
		}
		if s := w.metrics.Snapshot(); s.Stuck != 1 {
			t.Fatalf("metrics %+v", s)
		}
		list, err := w.admin().List(context.Background(), w.db.Pool, saga.ListFilter{State: saga.StateStuck})
		if err != nil || len(list) != 1 || list[0].ID != id || list[0].Step != "reserve" {
			t.Fatalf("list stuck = %+v, %v", list, err)
		}
		// Retrying a saga that is not stuck is refused.
		other := w.start("o-2")
		err = pgx.BeginFunc(context.Background(), w.db.Pool, func(tx pgx.Tx) error { return w.admin().RetryTx(context.Background(), tx, other) })
		if !errors.Is(err, saga.ErrWrongState) {
			t.Fatalf("retry of a running saga: %v", err)
		}
		w.mu.Lock()
		w.compFail["reserve"] = 0 // the cause is fixed
		w.mu.Unlock()
		if err := pgx.BeginFunc(context.Background(), w.db.Pool, func(tx pgx.Tx) error { return w.admin().RetryTx(context.Background(), tx, id) }); err != nil {
			t.Fatal(err)
		}
		d = w.runUntil(id, saga.StateCompensated)
		if d.Steps[0].Status != "compensated" || d.Steps[0].CompAttempts != 3 {
			t.Fatalf("after retry: %+v", d.Steps[0])
		}
		if got := w.effects(id); !slices.Equal(got, []string{"reserve/action", "reserve/compensation"}) {
			t.Fatalf("effects %v (the failed compensations' writes must be rolled back)", got)
		}
	})
}

// Starting the same id twice is one saga; the same id for another definition is refused.
func TestStartSameIDTwice(t *testing.T) {
	t.Parallel()
	w := newWorld(t, checkoutDef(t, nil))
	a := w.start("order-7")
	b := w.start("order-7")
	if a != "order-7" || b != a {
		t.Fatalf("ids %q, %q", a, b)
	}
	if n := w.count(`SELECT count(*) FROM ` + w.db.Schema + `.saga`); n != 1 {
		t.Fatalf("%d sagas, want 1", n)
	}
	if n := w.count(`SELECT count(*) FROM ` + w.db.Schema + `.outbox`); n != 1 {
		t.Fatalf("%d commands in the outbox, want 1", n)
	}
	other, err := saga.Define("refund", 1, []*saga.StepDef[Checkout]{
		saga.Step[Checkout]("x").Send("t", func(Checkout) (any, error) { return nil, nil }),
	})
	if err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(context.Background(), w.db.Pool, func(tx pgx.Tx) error {
		_, err := saga.StartTx(context.Background(), tx, other, Checkout{}, saga.WithID("order-7"), saga.WithWriter(w.writer()))
		return err
	})
	if !errors.Is(err, saga.ErrIDInUse) {
		t.Fatalf("start of another definition with the same id: %v", err)
	}
	// A start in a transaction that rolls back leaves nothing.
	_ = pgx.BeginFunc(context.Background(), w.db.Pool, func(tx pgx.Tx) error {
		if _, err := saga.StartTx(context.Background(), tx, w.def, Checkout{Order: "o-9"}, saga.WithID("o-9"), saga.WithWriter(w.writer())); err != nil {
			t.Fatal(err)
		}
		return errors.New("business write failed")
	})
	if n := w.count(`SELECT count(*) FROM ` + w.db.Schema + `.saga WHERE id = 'o-9'`); n != 0 {
		t.Fatal("a rolled-back start left a saga")
	}
}

// A step timeout re-sends the command as the next attempt, then compensates the step itself
// too (its effect is unknown): the barrier makes that compensation a no-op when the action
// never ran.
func TestTimeoutRetriesThenCompensatesUncertainStep(t *testing.T) {
	t.Parallel()
	def := checkoutDef(t, func(name string, s *saga.StepDef[Checkout]) {
		if name == "charge" {
			s.Attempts(2, time.Millisecond).Timeout(100 * time.Millisecond)
		}
	})
	w := newWorld(t, def, "charge") // the charge action's participant is down: its commands wait
	id := w.start("o-1")
	d := w.runUntil(id, saga.StateCompensated)
	if d.Steps[1].Attempts != 2 || !d.Steps[1].Uncertain {
		t.Fatalf("charge %+v, want 2 attempts, uncertain", d.Steps[1])
	}
	if got := w.effects(id); !slices.Equal(got, []string{"reserve/action", "reserve/compensation"}) {
		t.Fatalf("effects %v", got)
	}
	if s := w.metrics.Snapshot(); s.NullCompensations != 1 {
		t.Fatalf("metrics %+v: the charge's compensation should be a null compensation", s)
	}
	if w.calls["charge/compensation"] != 0 {
		t.Fatal("the compensation handler ran for an action that never ran")
	}
	// The charge commands arrive late, after the compensation: the barrier skips them.
	w.subscribeAction("charge", nil)
	if _, err := w.bus.Deliver(context.Background()); err != nil {
		t.Fatal(err)
	}
	if w.calls["charge/action"] != 0 || w.metrics.Snapshot().HangingActions == 0 {
		t.Fatalf("late action ran (%d calls) or was not counted (%+v)", w.calls["charge/action"], w.metrics.Snapshot())
	}
}

// The saga deadline: a saga still running when it is due compensates (the step in flight
// included, as a no-op if it never ran); a saga that completes first leaves no timer behind.
func TestSagaDeadline(t *testing.T) {
	t.Parallel()
	w := newWorld(t, checkoutDef(t, nil, saga.WithDeadline(300*time.Millisecond)), "charge")
	id := w.start("o-late")
	d := w.runUntil(id, saga.StateCompensated)
	if !strings.Contains(d.Error, "deadline exceeded") || !d.Steps[1].Uncertain {
		t.Fatalf("error %q, charge %+v", d.Error, d.Steps[1])
	}
	if got := w.effects(id); !slices.Equal(got, []string{"reserve/action", "reserve/compensation"}) {
		t.Fatalf("effects %v", got)
	}
	w.subscribeAction("charge", nil)
	id = w.start("o-fast")
	if d := w.runUntil(id, saga.StateCompleted, saga.StateCompensated); d.State != saga.StateCompleted || len(d.Timers) != 0 {
		t.Fatalf("state %s, timers %v", d.State, d.Timers)
	}
}

// A pivot is retried until it succeeds, past its attempts, and never compensated.
func TestPivotRetriedUntilSuccess(t *testing.T) {
	t.Parallel()
	cmd := func(c Checkout) (any, error) { return stepCmd{Order: c.Order}, nil }
	def := saga.MustDefine("checkout", 1, []*saga.StepDef[Checkout]{
		saga.Step[Checkout]("reserve").Send("cmd.reserve", cmd).Compensate("undo.reserve", cmd),
		saga.Step[Checkout]("charge").Send("cmd.charge", cmd).Attempts(2, time.Millisecond).Pivot(),
		saga.Step[Checkout]("confirm").Send("cmd.confirm", cmd).Attempts(2, time.Millisecond),
	})
	w := newWorld(t, def)
	w.transient["charge"] = 4
	w.fail["confirm"] = "temporarily refused" // after the pivot a business failure is retried too
	id := w.start("o-1")
	if err := w.bus.RunUntil(context.Background(), func() bool { return w.get(id).Steps[2].Attempts >= 3 }); err != nil {
		t.Fatal(err)
	}
	w.mu.Lock()
	delete(w.fail, "confirm")
	w.mu.Unlock()
	d := w.runUntil(id, saga.StateCompleted, saga.StateCompensated)
	if d.State != saga.StateCompleted || d.Steps[1].Attempts != 5 {
		t.Fatalf("state %s (%s), charge attempts %d; want completed after 5", d.State, d.Error, d.Steps[1].Attempts)
	}
	if got := w.effects(id); !slices.Equal(got, []string{"reserve/action", "charge/action", "confirm/action"}) {
		t.Fatalf("effects %v", got)
	}
	if s := w.metrics.Snapshot(); s.Compensated != 0 || s.Completed != 1 {
		t.Fatalf("metrics %+v", s)
	}
}

// An action that commits, but whose reply reaches the saga after the step's attempts timed
// out: the step is compensated as uncertain, with a command built from saga data that never
// got OnReply's payment id. CompensationFor's handler gets the action's own result (kept with
// its barrier row) and refunds exactly what the action charged.
func TestCompensationLearnsWhatALateActionDid(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		def := checkoutDef(t, func(name string, s *saga.StepDef[Checkout]) {
			if name == "charge" {
				s.Attempts(1, time.Millisecond).Timeout(100 * time.Millisecond)
			}
		})
		w := newWorldMode(t, batched, def, "!charge") // charge's participant is wired below
		p := w.participant("charge")
		slow := func(ctx context.Context, tx pgx.Tx, cmd stepCmd) (stepResult, error) {
			res, err := w.action("charge")(ctx, tx, cmd)
			time.Sleep(300 * time.Millisecond) // commits after the step timed out
			return res, err
		}
		var refunded []string
		refund := func(ctx context.Context, tx pgx.Tx, cmd stepCmd, done *stepResult) error {
			if done == nil {
				return errors.New("the action's result is unknown")
			}
			refunded = append(refunded, done.ID+" (command: "+cmd.Order+")")
			return w.compensation("charge")(ctx, tx, cmd)
		}
		if batched {
			w.bus.SubscribeBatch("cmd.charge", saga.ActionProcessor(p, slow))
			w.bus.SubscribeBatch("undo.charge", saga.CompensationForProcessor(p, refund))
		} else {
			w.bus.Subscribe("cmd.charge", saga.Action(p, slow))
			w.bus.Subscribe("undo.charge", saga.CompensationFor(p, refund))
		}
		id := w.start("o-1")
		d := w.runUntil(id, saga.StateCompensated)
		if !d.Steps[1].Uncertain || !strings.Contains(d.Error, "timed out") {
			t.Fatalf("charge %+v, saga error %q: want an uncertain step after a timeout", d.Steps[1], d.Error)
		}
		var data Checkout
		if err := json.Unmarshal(d.Data, &data); err != nil || data.PaymentID != "" {
			t.Fatalf("saga data %s: the late reply should not have reached OnReply", d.Data)
		}
		if got := strings.Join(refunded, ","); got != "charge-o-1 (command: o-1)" {
			t.Fatalf("refunded %q, want the payment the late action made", got)
		}
		if got := w.effects(id); !slices.Equal(got, []string{"reserve/action", "charge/action", "charge/compensation", "reserve/compensation"}) {
			t.Fatalf("effects %v", got)
		}
	})
}

// replied lists the replies a saga's history records, as "step:phase/attempt:outcome"; each
// must carry its event id.
func replied(d *saga.Detail) string {
	var out []string
	for _, s := range d.Steps {
		for _, r := range s.Replies {
			if r.EventID == "" || r.At.IsZero() {
				return fmt.Sprintf("reply %+v without its event id or time", r)
			}
			out = append(out, fmt.Sprintf("%s:%s/%d:%s", s.Name, r.Phase, r.Attempt, r.Outcome))
		}
	}
	return strings.Join(out, " ")
}
