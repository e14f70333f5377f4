package saga_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

// OnReplyTx runs in the transition's transaction: its writes and its change to the saga data
// commit with the saga's new state, once however often the reply is delivered; when it fails,
// its writes are rolled back (a savepoint) and the step is compensated with the ones before it.
func TestOnReplyTx(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		var w *world
		def := localDef(t, &w, []string{"+place", "reserve", "charge"}, func(name string, s *saga.StepDef[Checkout]) {
			if name == "place" {
				// A local compensation sees why the saga compensates (LocalRunFrom's Error),
				// though the saga row is stored only after it.
				s.CompensateLocal(func(ctx context.Context, tx pgx.Tx, c *Checkout) error {
					run, _ := saga.LocalRunFrom(ctx)
					if run.Phase != outbox.SagaPhaseCompensation || !strings.Contains(run.Error, "reservation id unusable") {
						return saga.Fail("LocalRunFrom: " + run.Error)
					}
					_, err := tx.Exec(ctx, `INSERT INTO `+w.db.Schema+`.effect (saga, step, phase) VALUES ($1, 'place', 'compensation')`, c.Order)
					return err
				})
			}
			if name != "reserve" {
				return
			}
			s.OnReplyTx(func(ctx context.Context, tx pgx.Tx, c *Checkout, r saga.Reply) error {
				run, ok := saga.LocalRunFrom(ctx)
				if !ok || run.ID != c.Order || run.Step != "reserve" || run.Attempt != r.Attempt {
					return errors.New("LocalRunFrom does not describe the reply's saga")
				}
				if _, err := tx.Exec(ctx, `INSERT INTO `+w.db.Schema+`.effect (saga, step, phase) VALUES ($1, 'reserve', 'reply')`, c.Order); err != nil {
					return err
				}
				c.Amount += 100
				if c.Order == "o-bad" {
					return errors.New("reservation id unusable")
				}
				return nil
			})
		})
		w = newWorldMode(t, batched, def)
		if _, err := w.db.Pool.Exec(context.Background(), `CREATE TABLE `+w.db.Schema+`.local_run (seq bigserial PRIMARY KEY, saga text NOT NULL, step text NOT NULL, txid bigint NOT NULL)`); err != nil {
			t.Fatal(err)
		}
		w.bus.DeliverTwice = true // a duplicate reply runs nothing
		ok, bad := w.start("o-ok", saga.RunLocalSteps()), w.start("o-bad", saga.RunLocalSteps())

		d := w.runUntil(ok, saga.StateCompleted, saga.StateCompensated)
		want := []string{"place/action", "reserve/action", "reserve/reply", "charge/action"}
		if got := w.effects(ok); d.State != saga.StateCompleted || !slices.Equal(got, want) || amount(t, d) != 143 {
			t.Fatalf("o-ok: %s, effects %v (want %v), amount %d (want 143)", d.State, got, want, amount(t, d))
		}
		// The handler's row and its +100 are gone with its failure; the reserve step is
		// compensated (its effect happened), then place.
		d = w.runUntil(bad, saga.StateCompleted, saga.StateCompensated)
		want = []string{"place/action", "reserve/action", "reserve/compensation", "place/compensation"}
		if got := w.effects(bad); d.State != saga.StateCompensated || !slices.Equal(got, want) || amount(t, d) != 43 ||
			!strings.Contains(d.Error, "reservation id unusable") {
			t.Fatalf("o-bad: %s (%q), effects %v (want %v), amount %d (want 43)", d.State, d.Error, got, want, amount(t, d))
		}
	})
}

func TestOnReplyTxDefinitionChecks(t *testing.T) {
	t.Parallel()
	build := func(Checkout) (any, error) { return nil, nil }
	h := func(context.Context, pgx.Tx, *Checkout, saga.Reply) error { return nil }
	for _, c := range []struct {
		step *saga.StepDef[Checkout]
		want string
	}{
		{saga.Step[Checkout]("a").Send("t", build).OnReply(func(*Checkout, saga.Reply) error { return nil }).OnReplyTx(h), "both OnReply and OnReplyTx"},
		{saga.Step[Checkout]("a").Local(func(context.Context, pgx.Tx, *Checkout) error { return nil }).OnReplyTx(h), "OnReply on a local step"},
	} {
		if _, err := saga.Define("x", 1, []*saga.StepDef[Checkout]{c.step}); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("got %v, want %q", err, c.want)
		}
	}
}
