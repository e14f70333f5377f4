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
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/saga"
)

// A saga that stays stuck longer than the dedup window keeps its participants' barrier rows:
// the inbox cleaner removes every other row of that age, and a retry however late is decided
// by the barrier. Stuck at its pivot `charge` (the completion hook failed), retried four days
// later: the action ran once in total, answered from the result it kept. Stuck compensating
// `charge` (its refund kept failing), retried four days later: the compensation's handler
// runs — the action's row says the charge took effect — instead of a null compensation that
// would leave the charge in place. Once the saga has finished, its barrier rows age out like
// any other dedup row.
func TestLateRetryAfterRetention(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// ageAndClean makes every dedup row four days old and runs the inbox cleaner with the
	// default window (72 h); it returns how many rows it removed.
	// With viaSagas, the cleaner asks Admin.Alive which sagas live (CleanerConfig.Sagas, as a
	// participant whose orchestrator has another database does) instead of reading the saga
	// table of its schema.
	ageAndClean := func(t *testing.T, w *world, viaSagas bool) int64 {
		t.Helper()
		if _, err := w.db.Pool.Exec(ctx, `UPDATE `+w.db.Schema+`.processed_event SET processed_at = now() - interval '4 days'`); err != nil {
			t.Fatal(err)
		}
		cfg := inbox.CleanerConfig{Pool: w.db.Pool, Schema: w.db.Schema, BatchSize: 2}
		if viaSagas {
			cfg.Sagas = func(ctx context.Context, ids []string) ([]string, error) { return w.admin().Alive(ctx, w.db.Pool, ids) }
		}
		c, err := inbox.NewCleaner(cfg)
		if err != nil {
			t.Fatal(err)
		}
		n, err := c.Clean(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			t.Fatal("the cleaner removed nothing: the test ages no ordinary dedup rows")
		}
		if left := w.count(`SELECT count(*) FROM ` + w.db.Schema + `.processed_event WHERE saga_id IS NULL`); left != 0 {
			t.Fatalf("%d ordinary dedup rows older than the window left", left)
		}
		return n
	}

	stuckAtThePivot := func(t *testing.T, viaSagas bool) {
		var hookFails atomic.Bool
		hookFails.Store(true)
		hook := saga.OnCompleted(func(context.Context, pgx.Tx, *Checkout) error {
			if hookFails.Load() {
				return errors.New("orders table locked")
			}
			return nil
		})
		def := pivotCheckout(t, hook)
		w := newWorld(t, def)
		id := w.start("o-1")
		if d := w.runUntil(id, saga.StateStuck, saga.StateCompleted, saga.StateCompensated); d.State != saga.StateStuck {
			t.Fatalf("saga %s (%q), want stuck by the hook", d.State, d.Error)
		}
		ageAndClean(t, w, viaSagas)
		hookFails.Store(false)
		w.retryNow(id)
		d := w.runUntil(id, saga.StateCompleted, saga.StateCompensated, saga.StateStuck)
		w.mu.Lock()
		calls := w.calls["charge/action"]
		w.mu.Unlock()
		if got := w.effects(id); d.State != saga.StateCompleted || calls != 1 || !slices.Equal(got, []string{"reserve/action", "charge/action"}) {
			t.Fatalf("after a retry past the window: saga %s (%q), charge handler ran %d times, effects %v; want completed, charged once",
				d.State, d.Error, calls, got)
		}
		// Finished, the saga's barrier rows age out like any other.
		ageAndClean(t, w, viaSagas)
		if n := w.count(`SELECT count(*) FROM ` + w.db.Schema + `.processed_event`); n != 0 {
			t.Fatalf("%d dedup rows of a finished saga left past the window", n)
		}
	}

	t.Run("stuck at the pivot", func(t *testing.T) {
		t.Parallel()
		for _, viaSagas := range []bool{false, true} {
			t.Run(map[bool]string{false: "same database", true: "CleanerConfig.Sagas"}[viaSagas], func(t *testing.T) {
				t.Parallel()
				stuckAtThePivot(t, viaSagas)
			})
		}
	})

	// Per-message and batched participants (the orchestrator's batched path gives a failing
	// reply up only behind a real consumer, so the forward case runs per message).
	t.Run("stuck compensating", func(t *testing.T) {
		t.Parallel()
		forModes(t, func(t *testing.T, batched bool) {
			w := newWorldMode(t, batched, checkoutDef(t, nil, saga.WithCompensationAttempts(2, 10*time.Millisecond)))
			w.fail["confirm"] = "declined"
			w.compFail["charge"] = -1 // the refund keeps failing until the test fixes it
			id := w.start("o-1")
			d := w.runUntil(id, saga.StateStuck, saga.StateCompleted, saga.StateCompensated)
			if d.State != saga.StateStuck || d.Step != "charge" || !strings.Contains(d.Error, "refund service down") {
				t.Fatalf("saga %s at %s (%q), want stuck compensating charge", d.State, d.Step, d.Error)
			}
			ageAndClean(t, w, batched)
			w.mu.Lock()
			w.compFail["charge"] = 0
			w.mu.Unlock()
			w.retryNow(id)
			d = w.runUntil(id, saga.StateCompleted, saga.StateCompensated, saga.StateStuck)
			want := []string{"reserve/action", "charge/action", "charge/compensation", "reserve/compensation"}
			if got := w.effects(id); d.State != saga.StateCompensated || !slices.Equal(got, want) {
				t.Fatalf("after a retry past the window: saga %s (%q), effects %v; want compensated with %v", d.State, d.Error, got, want)
			}
		})
	})
}

// A saga stuck moving forward while its saga-wide deadline fell due (the deadline's timer
// found it stuck and was dropped) compensates when it is retried, as the deadline would have
// made it: its current step too, whose action took effect. Retried forward instead, it used
// to run on with no deadline at all.
func TestRetryPastTheDeadlineCompensates(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var hookFails atomic.Bool
	hookFails.Store(true)
	hook := saga.OnCompleted(func(context.Context, pgx.Tx, *Checkout) error {
		if hookFails.Load() {
			return errors.New("orders table locked")
		}
		return nil
	})
	w := newWorld(t, checkoutDef(t, nil, hook, saga.WithDeadline(time.Second)))
	id := w.start("o-1")
	if d := w.runUntil(id, saga.StateStuck, saga.StateCompleted, saga.StateCompensated); d.State != saga.StateStuck {
		t.Fatalf("saga %s (%q), want stuck by the hook", d.State, d.Error)
	}
	// The deadline falls due while the saga is stuck; its timer fires and changes nothing.
	testutil.AwaitWithin(t, 30*time.Second, "the deadline's timer to fire while the saga is stuck", func() bool {
		if _, err := w.orch.FireDue(ctx); err != nil {
			t.Fatal(err)
		}
		return w.count(`SELECT count(*) FROM `+w.db.Schema+`.saga_timer WHERE saga_id = $1 AND kind = 'deadline'`, id) == 0
	}, func() string { return string(w.get(id).State) })
	if d := w.get(id); d.State != saga.StateStuck {
		t.Fatalf("after its deadline fell due: saga %s, want still stuck", d.State)
	}
	hookFails.Store(false)
	w.retryNow(id)
	d := w.runUntil(id, saga.StateCompleted, saga.StateCompensated, saga.StateStuck)
	want := []string{"reserve/action", "charge/action", "confirm/action", "confirm/compensation", "charge/compensation", "reserve/compensation"}
	if got := w.effects(id); d.State != saga.StateCompensated || !strings.Contains(d.Error, "deadline") || !slices.Equal(got, want) {
		t.Fatalf("retried past its deadline: saga %s (%q), effects %v; want compensated for the deadline with %v", d.State, d.Error, got, want)
	}
}

// A barrier row lost while its saga lives (deleted by hand here; or by a cleaner of another
// database without CleanerConfig.Sagas) cannot make an effect happen twice or stay in place:
// the orchestrator knows the action took effect (its participant answered done) and says so
// in the step's later commands. Stuck at the pivot, the retry's action is refused and the
// saga stops stuck with the reason — the charge ran once. Stuck compensating, the
// compensation's handler runs instead of a null compensation.
func TestLostBarrierRowIsNeverTakenForAnActionThatNeverRan(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	loseBarrier := func(t *testing.T, w *world) {
		t.Helper()
		tag, err := w.db.Pool.Exec(ctx, `DELETE FROM `+w.db.Schema+`.processed_event WHERE saga_id IS NOT NULL`)
		if err != nil || tag.RowsAffected() == 0 {
			t.Fatalf("delete the barrier rows: %v, %d rows", err, tag.RowsAffected())
		}
	}
	t.Run("stuck at the pivot", func(t *testing.T) {
		t.Parallel()
		hook := saga.OnCompleted(func(context.Context, pgx.Tx, *Checkout) error { return errors.New("orders table locked") })
		def := pivotCheckout(t, hook)
		w := newWorld(t, def)
		id := w.start("o-1")
		if d := w.runUntil(id, saga.StateStuck, saga.StateCompleted, saga.StateCompensated); d.State != saga.StateStuck || !d.Steps[1].TookEffect {
			t.Fatalf("saga %s (%q), charge %+v; want stuck by the hook, the charge recorded as took effect", d.State, d.Error, d.Steps[1])
		}
		loseBarrier(t, w)
		w.retryNow(id)
		w.runUntil(id, saga.StateRunning, saga.StateCompleted) // the retry was applied
		d := w.runUntil(id, saga.StateStuck, saga.StateCompleted, saga.StateCompensated)
		w.mu.Lock()
		calls := w.calls["charge/action"]
		w.mu.Unlock()
		if d.State != saga.StateStuck || !strings.Contains(d.Error, "refused") || !strings.Contains(d.Error, "no record") || calls != 1 {
			t.Fatalf("retried without its barrier row: saga %s (%q), charge handler ran %d times; want stuck with the refusal, charged once",
				d.State, d.Error, calls)
		}
		if got := w.effects(id); !slices.Equal(got, []string{"reserve/action", "charge/action"}) {
			t.Fatalf("effects %v", got)
		}
	})
	t.Run("stuck compensating", func(t *testing.T) {
		t.Parallel()
		w := newWorld(t, checkoutDef(t, nil, saga.WithCompensationAttempts(2, 10*time.Millisecond)))
		w.fail["confirm"] = "declined"
		w.compFail["charge"] = -1
		id := w.start("o-1")
		if d := w.runUntil(id, saga.StateStuck, saga.StateCompleted, saga.StateCompensated); d.State != saga.StateStuck || d.Step != "charge" {
			t.Fatalf("saga %s at %s (%q), want stuck compensating charge", d.State, d.Step, d.Error)
		}
		loseBarrier(t, w)
		w.mu.Lock()
		w.compFail["charge"] = 0
		w.mu.Unlock()
		w.retryNow(id)
		d := w.runUntil(id, saga.StateCompleted, saga.StateCompensated, saga.StateStuck)
		want := []string{"reserve/action", "charge/action", "charge/compensation", "reserve/compensation"}
		if got := w.effects(id); d.State != saga.StateCompensated || !slices.Equal(got, want) {
			t.Fatalf("retried without its barrier rows: saga %s (%q), effects %v; want compensated with %v", d.State, d.Error, got, want)
		}
	})
}

// retryNow files an operator's retry of the stuck saga id and fires it at once.
func (w *world) retryNow(id string) {
	w.t.Helper()
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, w.db.Pool, func(tx pgx.Tx) error { return w.admin().RetryTx(ctx, tx, id) }); err != nil {
		w.t.Fatal(err)
	}
	if _, err := w.orch.FireDue(ctx); err != nil {
		w.t.Fatal(err)
	}
}

// pivotCheckout is reserve (compensated by undo.reserve) → charge, the pivot.
func pivotCheckout(t *testing.T, opts ...saga.Option) *saga.Definition[Checkout] {
	t.Helper()
	def, err := saga.Define("checkout", 1, []*saga.StepDef[Checkout]{
		saga.Step[Checkout]("reserve").Send("cmd.reserve", cmdOf).Compensate("undo.reserve", cmdOf),
		saga.Step[Checkout]("charge").Send("cmd.charge", cmdOf).Pivot(),
	}, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return def
}
