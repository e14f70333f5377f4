package saga_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

// command builds the message an orchestrator sends for step "reserve" of saga id.
func command(id string, phase outbox.SagaPhase, attempt int) *message.Message {
	msg := outbox.SetSaga(outbox.NewMessage([]byte(`{"order":"`+id+`"}`)), outbox.SagaRef{ID: id, Step: "reserve", Phase: phase, Attempt: attempt})
	msg.Metadata.Set(outbox.MetadataSagaName, "checkout")
	msg.Metadata.Set(outbox.MetadataSagaReplyTo, "checkout.replies")
	msg.SetContext(context.Background())
	return msg
}

// barrierWorld is one participant (consumer "inventory") whose action and compensation
// record their effects.
type barrierWorld struct {
	*world
	action, compensation message.NoPublishHandlerFunc
}

func newBarrierWorld(t *testing.T, slowAction time.Duration, batched ...bool) *barrierWorld {
	w := newWorld(t, checkoutDef(t, nil))
	p := w.participant("reserve")
	act := w.action("reserve")
	slow := func(ctx context.Context, tx pgx.Tx, cmd stepCmd) (stepResult, error) {
		res, err := act(ctx, tx, cmd)
		time.Sleep(slowAction) // holds the barrier row while a compensation arrives
		return res, err
	}
	if len(batched) > 0 && batched[0] {
		// Each delivery a batch of one, through the batched processors.
		single := func(bp inbox.BatchProcessor) message.NoPublishHandlerFunc {
			return func(msg *message.Message) error { return bp.ProcessBatch(msg.Context(), []*message.Message{msg}) }
		}
		return &barrierWorld{world: w, action: single(saga.ActionProcessor(p, slow)),
			compensation: single(saga.CompensationProcessor(p, w.compensation("reserve")))}
	}
	return &barrierWorld{world: w, action: saga.Action(p, slow), compensation: saga.Compensation(p, w.compensation("reserve"))}
}

// replies returns the outcomes of the replies in the outbox, as "phase:outcome".
func (w *barrierWorld) replies() []string {
	w.t.Helper()
	rows, err := w.db.Pool.Query(context.Background(), `SELECT metadata->>'saga_phase' || ':' || (metadata->>'saga_outcome') FROM `+w.db.Schema+`.outbox WHERE topic = 'checkout.replies' ORDER BY id`)
	if err != nil {
		w.t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		w.t.Fatal(err)
	}
	return out
}

// Compensation before action: recorded and answered as a no-op (null compensation); the
// action arriving afterwards is skipped (no hanging reservation). Duplicates of either are
// dedup hits.
func TestBarrierCompensationBeforeAction(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		w := newBarrierWorld(t, 0, batched)
		for range 2 {
			if err := w.compensation(command("s1", outbox.SagaPhaseCompensation, 1)); err != nil {
				t.Fatal(err)
			}
		}
		for range 2 {
			if err := w.action(command("s1", outbox.SagaPhaseAction, 1)); err != nil {
				t.Fatal(err)
			}
		}
		if fx := w.effects("s1"); len(fx) != 0 {
			t.Fatalf("effects %v, want none", fx)
		}
		if w.calls["reserve/action"] != 0 || w.calls["reserve/compensation"] != 0 {
			t.Fatalf("handler calls %v, want none", w.calls)
		}
		if got := strings.Join(w.replies(), " "); got != "compensation:done" {
			t.Fatalf("replies %q, want one compensation:done", got)
		}
		s := w.metrics.Snapshot()
		if s.NullCompensations != 1 || s.HangingActions != 1 || s.Duplicates != 2 {
			t.Fatalf("barrier metrics %+v, want 1 null compensation, 1 hanging action, 2 duplicates", s)
		}
	})
}

// Action, then its compensation: both run once, whatever the duplicates; a re-sent action
// attempt after the effect is not run again but answered with the result the first kept (its
// first reply may be the one the orchestrator gave up on).
func TestBarrierActionThenCompensation(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		w := newBarrierWorld(t, 0, batched)
		for _, m := range []*message.Message{
			command("s1", outbox.SagaPhaseAction, 1), command("s1", outbox.SagaPhaseAction, 1), command("s1", outbox.SagaPhaseAction, 2),
		} {
			if err := w.action(m); err != nil {
				t.Fatal(err)
			}
		}
		for range 2 {
			if err := w.compensation(command("s1", outbox.SagaPhaseCompensation, 1)); err != nil {
				t.Fatal(err)
			}
		}
		if got := strings.Join(w.effects("s1"), " "); got != "reserve/action reserve/compensation" {
			t.Fatalf("effects %q", got)
		}
		if got := strings.Join(w.replies(), " "); got != "action:done action:done compensation:done" {
			t.Fatalf("replies %q", got)
		}
	})
}

// An action's first attempt delivered again after its dedup row was removed (an operator
// re-driving it; its barrier row stays): not run again, answered with the result it kept.
func TestBarrierRedriveAnsweredWithKeptResult(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		w := newBarrierWorld(t, 0, batched)
		if err := w.action(command("s1", outbox.SagaPhaseAction, 1)); err != nil {
			t.Fatal(err)
		}
		key, err := inbox.SagaKey(outbox.SagaRef{ID: "s1", Step: "reserve", Phase: outbox.SagaPhaseAction, Attempt: 1})
		if err != nil {
			t.Fatal(err)
		}
		if n := w.count(`DELETE FROM `+w.db.Table("processed_event")+` WHERE dedup_key = $1 RETURNING 1`, key); n != 1 {
			t.Fatalf("removed %d dedup rows, want 1", n)
		}
		if err := w.action(command("s1", outbox.SagaPhaseAction, 1)); err != nil {
			t.Fatal(err)
		}
		if w.calls["reserve/action"] != 1 {
			t.Fatalf("handler calls %v, want the action once", w.calls)
		}
		rows, err := w.db.Pool.Query(context.Background(), `SELECT convert_from(payload, 'UTF8') FROM `+w.db.Table("outbox")+` WHERE topic = 'checkout.replies' ORDER BY id`)
		if err != nil {
			t.Fatal(err)
		}
		payloads, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		if len(payloads) != 2 || payloads[0] != payloads[1] || payloads[0] == "{}" {
			t.Fatalf("reply payloads %q, want the first reply's result twice", payloads)
		}
	})
}

// Action and compensation at the same time, many times: either the action ran and was
// compensated, or neither ran — never an action left standing, never a compensation of
// nothing, never a double effect.
func TestBarrierConcurrentActionAndCompensation(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		w := newBarrierWorld(t, 5*time.Millisecond, batched)
		for i := range 30 {
			id := "s" + string(rune('a'+i%26)) + strings.Repeat("x", i/26)
			var wg sync.WaitGroup
			errs := make(chan error, 4)
			for _, run := range []func() error{
				func() error { return w.action(command(id, outbox.SagaPhaseAction, 1)) },
				func() error { return w.compensation(command(id, outbox.SagaPhaseCompensation, 1)) },
				func() error { return w.action(command(id, outbox.SagaPhaseAction, 1)) },
				func() error { return w.compensation(command(id, outbox.SagaPhaseCompensation, 1)) },
			} {
				wg.Add(1)
				go func() { defer wg.Done(); errs <- run() }()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				if err != nil {
					t.Fatal(err)
				}
			}
			fx := strings.Join(w.effects(id), " ")
			if fx != "" && fx != "reserve/action reserve/compensation" {
				t.Fatalf("saga %s: effects %q; want none, or the action then its compensation", id, fx)
			}
		}
	})
}

// A participant's handler that ends its transaction with SQL fails its try and keeps nothing
// of it: the next try runs on a fresh transaction, and the effect is applied once. A handler
// that does it every time is answered as a failed attempt carrying the error, with nothing of
// its writes kept.
func TestParticipantHandlerCannotCommit(t *testing.T) {
	t.Parallel()
	w := newWorld(t, checkoutDef(t, nil))
	p, err := saga.NewParticipant(saga.ParticipantConfig{Pool: w.db.Pool, Schema: w.db.Schema, Consumer: "svc-reserve", MaxAttempts: 2})
	if err != nil {
		t.Fatal(err)
	}
	commits := map[string]int{"s1": 1, "s2": 99} // how many tries of each saga commit
	tries := map[string]int{}
	h := saga.Action(p, func(ctx context.Context, tx pgx.Tx, cmd stepCmd) (stepResult, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO `+w.db.Schema+`.effect (saga, step, phase) VALUES ($1, 'reserve', 'action')`, cmd.Order); err != nil {
			return stepResult{}, err
		}
		tries[cmd.Order]++
		if tries[cmd.Order] <= commits[cmd.Order] {
			_, _ = tx.Exec(ctx, `COMMIT`) // refused; the handler ignores the error
		}
		return stepResult{ID: "r"}, nil
	})
	if err := h(command("s1", outbox.SagaPhaseAction, 1)); err != nil {
		t.Fatal(err)
	}
	if fx := w.effects("s1"); len(fx) != 1 || tries["s1"] != 2 {
		t.Fatalf("effects %v after %d tries; want the second try's only", fx, tries["s1"])
	}
	if err := h(command("s2", outbox.SagaPhaseAction, 1)); err != nil {
		t.Fatal(err)
	}
	if fx := w.effects("s2"); len(fx) != 0 {
		t.Fatalf("effects %v kept of tries that committed with SQL", fx)
	}
	var outcome, reason string
	if err := w.db.Pool.QueryRow(context.Background(), `SELECT metadata->>'`+outbox.MetadataSagaOutcome+`', metadata->>'`+outbox.MetadataSagaReason+`' FROM `+
		w.db.Schema+`.outbox WHERE metadata->>'`+outbox.MetadataSagaID+`' = 's2'`).Scan(&outcome, &reason); err != nil {
		t.Fatalf("the reply to s2: %v", err)
	}
	if outcome != outbox.SagaOutcomeRetry || !strings.Contains(reason, "COMMIT") {
		t.Fatalf("reply to s2: outcome %q, reason %q; want a failed attempt saying why", outcome, reason)
	}
}

// A batched action whose result the outbox refuses (a reply over the payload limit) fails its
// own command, not the batch: the consumer isolates that command instead of retrying the
// batch forever.
func TestBatchedActionWithARefusedReplyFailsOnlyItsCommand(t *testing.T) {
	t.Parallel()
	w := newWorld(t, checkoutDef(t, nil))
	p := w.participant("reserve")
	proc := saga.ActionProcessor(p, func(ctx context.Context, tx pgx.Tx, cmd stepCmd) (stepResult, error) {
		if cmd.Order == "s2" {
			return stepResult{ID: strings.Repeat("x", 2<<20)}, nil // over the outbox's 1 MiB
		}
		return stepResult{ID: "r-" + cmd.Order}, nil
	})
	batch := []*message.Message{command("s1", outbox.SagaPhaseAction, 1), command("s2", outbox.SagaPhaseAction, 1), command("s3", outbox.SagaPhaseAction, 1)}
	err := proc.ProcessBatch(context.Background(), batch)
	var me *inbox.MessageError
	if !errors.As(err, &me) || me.Index != 1 || !errors.Is(err, outbox.ErrPayloadTooLarge) {
		t.Fatalf("err = %v; want a MessageError for command 1 saying the payload is too large", err)
	}
}
