package saga_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/onceflow/onceflow/saga"
)

// waitPending delivers messages and fires timers until at least n commands wait on topic.
func (w *world) waitPending(topic string, n int) {
	w.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for w.count(`SELECT count(*) FROM `+w.db.Schema+`.outbox WHERE topic = $1`, topic) < n {
		if time.Now().After(deadline) {
			w.t.Fatalf("fewer than %d commands on %s after 30s", n, topic)
		}
		if _, err := w.bus.Deliver(context.Background()); err != nil {
			w.t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Attempt 1 of reserve times out unanswered, attempt 2 is sent, and both reach the batched
// participant in one batch: the handler runs once, both attempts are answered (the second
// with the result the first kept), and the saga completes. (It used to run neither, commit
// the barrier row, skip every later attempt, and compensate an action that never ran.)
func TestTwoAttemptsOfAStepInOneBatch(t *testing.T) {
	t.Parallel()
	def := checkoutDef(t, func(name string, s *saga.StepDef[Checkout]) {
		if name == "reserve" {
			s.Timeout(time.Second)
		}
	})
	w := newWorldMode(t, true, def, "reserve")
	id := w.start("o-1")
	w.waitPending("cmd.reserve", 2)
	w.bus.SubscribeBatch("cmd.reserve", saga.ActionProcessor(w.participant("reserve"), w.action("reserve")))
	d := w.runUntil(id, saga.StateCompleted, saga.StateCompensated, saga.StateStuck)
	if got := w.effects(id); d.State != saga.StateCompleted || !slices.Equal(got, []string{"reserve/action", "charge/action", "confirm/action"}) {
		t.Fatalf("saga %s (%q), effects %v", d.State, d.Error, got)
	}
	if d.Steps[0].Sent[0].EventID == "" || d.Steps[0].Attempts < 2 {
		t.Fatalf("reserve was not sent twice: %+v", d.Steps[0])
	}
	w.mu.Lock()
	calls := w.calls["reserve/action"]
	w.mu.Unlock()
	if calls != 1 {
		t.Fatalf("reserve's handler ran %d times, want 1", calls)
	}
}

// The compensation variant: charge is declined, reserve's compensation attempt 1 times out
// unanswered and attempt 2 is sent; both reach the batched participant in one batch: the
// compensation runs once and the saga is compensated. (It used to record the compensation
// without running it, and the saga stayed stuck for good.)
func TestTwoCompensationAttemptsInOneBatch(t *testing.T) {
	t.Parallel()
	def := checkoutDef(t, func(name string, s *saga.StepDef[Checkout]) {
		if name == "reserve" {
			s.Timeout(time.Second)
		}
	})
	w := newWorldMode(t, true, def, "!reserve")
	p := w.participant("reserve")
	w.bus.SubscribeBatch("cmd.reserve", saga.ActionProcessor(p, w.action("reserve")))
	w.failOrder["o-1"] = "charge"
	id := w.start("o-1")
	w.waitPending("undo.reserve", 2)
	w.bus.SubscribeBatch("undo.reserve", saga.CompensationProcessor(p, w.compensation("reserve")))
	d := w.runUntil(id, saga.StateCompleted, saga.StateCompensated, saga.StateStuck)
	if got := w.effects(id); d.State != saga.StateCompensated || !slices.Equal(got, []string{"reserve/action", "reserve/compensation"}) {
		t.Fatalf("saga %s (%q), effects %v", d.State, d.Error, got)
	}
	w.mu.Lock()
	calls := w.calls["reserve/compensation"]
	w.mu.Unlock()
	if calls != 1 || d.Steps[0].CompAttempts < 2 {
		t.Fatalf("compensation handler ran %d times (want 1) for %d attempts (want ≥ 2)", calls, d.Steps[0].CompAttempts)
	}
}
