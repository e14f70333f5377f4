package saga_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

// consumerKinds builds, on w's database, one processor of each kind of consumer the engine
// runs, each with the commit timeout given (0: the default) and with h as its handler's body,
// and a message each one applies (new: its dedup key not seen before). The router's inbox
// middleware is a processor of one message here: its error is what the router sees, and its
// panic, recovered as Watermill's Recoverer would, the message's.
func consumerKinds(t *testing.T, w *world, commitTimeout time.Duration, h func()) map[string]func(ctx context.Context) error {
	t.Helper()
	ib, err := inbox.New(inbox.Config{Pool: w.db.Pool, Schema: w.db.Schema, Consumer: "billing", CommitTimeout: commitTimeout})
	if err != nil {
		t.Fatal(err)
	}
	inboxHandler := func(*message.Message) ([]*message.Message, error) { h(); return nil, nil }
	p, err := saga.NewParticipant(saga.ParticipantConfig{Pool: w.db.Pool, Schema: w.db.Schema, Consumer: "svc-charge", CommitTimeout: commitTimeout})
	if err != nil {
		t.Fatal(err)
	}
	action := saga.ActionProcessor(p, func(context.Context, pgx.Tx, stepCmd) (stepResult, error) { h(); return stepResult{ID: "p-1"}, nil })
	def := checkoutDef(t, func(name string, s *saga.StepDef[Checkout]) {
		if name == "reserve" {
			s.OnReply(func(*Checkout, saga.Reply) error { h(); return nil })
		}
	})
	o, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: w.db.Pool, Schema: w.db.Schema, Consumer: "orch-kinds", CommitTimeout: commitTimeout})
	if err != nil {
		t.Fatal(err)
	}
	if err := saga.Register(o, def); err != nil {
		t.Fatal(err)
	}
	id := w.start("o-kinds") // a saga of w's definition (the same name and version) waiting for reserve
	command := func() *message.Message {
		m := outbox.SetSaga(outbox.NewMessage([]byte(`{"order":"o-kinds"}`)), outbox.SagaRef{ID: id, Step: "charge", Phase: outbox.SagaPhaseAction, Attempt: 1})
		m.Metadata.Set(outbox.MetadataSagaReplyTo, "saga.checkout.replies")
		m.Metadata.Set(outbox.MetadataSagaName, "checkout")
		return m
	}
	reply := func() *message.Message {
		m := outbox.SetSaga(outbox.NewMessage([]byte(`{"id":"r-1"}`)), outbox.SagaRef{ID: id, Step: "reserve", Phase: outbox.SagaPhaseAction, Attempt: 1})
		m.Metadata.Set(outbox.MetadataSagaName, "checkout")
		m.Metadata.Set(outbox.MetadataSagaOutcome, outbox.SagaOutcomeDone)
		return m
	}
	batch := func(p inbox.BatchProcessor, m func() *message.Message) func(ctx context.Context) error {
		return func(ctx context.Context) error { return p.ProcessBatch(ctx, []*message.Message{m()}) }
	}
	return map[string]func(ctx context.Context) error{
		"inbox batch": batch(ib.Batch("", inboxHandler), func() *message.Message { return outbox.NewMessage([]byte("x")) }),
		"inbox set handler": batch(ib.BatchFunc("", func(context.Context, pgx.Tx, []*message.Message) ([]*message.Message, error) {
			h()
			return nil, nil
		}), func() *message.Message { return outbox.NewMessage([]byte("x")) }),
		"inbox middleware": func(ctx context.Context) (err error) {
			msg := outbox.NewMessage([]byte("x"))
			msg.SetContext(ctx)
			defer func() {
				if v := recover(); v != nil {
					err = &inbox.MessageError{Err: &panicked{v}} // Watermill's Recoverer's part
				}
			}()
			_, err = ib.Middleware(inboxHandler)(msg)
			return err // a handler's error comes back unwrapped: only a panic is the message's here
		},
		"participant":  batch(action, command),
		"orchestrator": batch(o, reply),
	}
}

type panicked struct{ v any }

func (p *panicked) Error() string { return "recovered in the router: " + p.v.(string) }

// The engine's one panic policy: a handler that panics, in every kind of consumer, fails its
// own message with an error wrapping inbox.ErrPanicked (an attempt is counted; nothing of the
// transaction is kept), never the consumer. Only the router's middleware panics again, with
// the original value, after its rollback, so Watermill's Recoverer sees it.
func TestPanicIsTheMessagesErrorInEveryConsumer(t *testing.T) {
	t.Parallel()
	w := newWorld(t, checkoutDef(t, nil), "reserve")
	kinds := consumerKinds(t, w, 0, func() { panic("boom") })
	for name, process := range kinds {
		err := process(context.Background())
		var me *inbox.MessageError
		switch {
		case !errors.As(err, &me):
			t.Errorf("%s: %v (%T), want the message's error", name, err, err)
		case name == "inbox middleware":
			if pe := (*panicked)(nil); !errors.As(err, &pe) || pe.v != "boom" {
				t.Errorf("%s: %v, want the original panic for Recoverer", name, err)
			}
		case !errors.Is(err, inbox.ErrPanicked):
			t.Errorf("%s: %v, want an error wrapping inbox.ErrPanicked", name, err)
		}
	}
	if n := w.count(`SELECT count(*) FROM ` + w.db.Schema + `.processed_event WHERE consumer IN ('billing', 'svc-charge', 'orch-kinds')`); n != 0 {
		t.Errorf("%d dedup rows kept by panicked transactions", n)
	}
}

// The engine's one commit timeout: every kind of consumer bounds its writes and COMMIT by its
// configured CommitTimeout (one default, inbox.DefaultCommitTimeout), detached from the
// message's context. Here a deferred trigger makes every COMMIT that records a dedup row take
// 5 s; with CommitTimeout 300 ms each consumer gives its COMMIT up after about that long, and
// the failure is the transaction's (retried without counting an attempt), not the message's.
func TestCommitTimeoutIsTheConfiguredOneInEveryConsumer(t *testing.T) {
	t.Parallel()
	w := newWorld(t, checkoutDef(t, nil), "reserve")
	ctx := context.Background()
	for _, sql := range []string{
		`CREATE TABLE ` + w.db.Schema + `.slow_commit (on_ boolean)`,
		`CREATE FUNCTION ` + w.db.Schema + `.slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN IF EXISTS (SELECT 1 FROM ` + w.db.Schema + `.slow_commit) THEN PERFORM pg_sleep(5); END IF; RETURN NULL; END $$`,
		`CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON ` + w.db.Schema + `.processed_event
			DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ` + w.db.Schema + `.slow_commit()`,
		`INSERT INTO ` + w.db.Schema + `.slow_commit VALUES (true)`,
	} {
		if _, err := w.db.Pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	const timeout = 300 * time.Millisecond
	for name, process := range consumerKinds(t, w, timeout, func() {}) {
		start := time.Now()
		err := process(ctx)
		took := time.Since(start)
		var me *inbox.MessageError
		switch {
		case err == nil:
			t.Errorf("%s: committed despite the 5 s commit", name)
		case errors.As(err, &me):
			t.Errorf("%s: %v, want the transaction's failure (no attempt counted)", name, err)
		case took < timeout || took > 3*time.Second:
			t.Errorf("%s: gave up after %s, want about the commit timeout (%s): %v", name, took, timeout, err)
		}
	}
	o, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: w.db.Pool, Schema: w.db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{Pool: w.db.Pool, Schema: w.db.Schema, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	if o.Config().CommitTimeout != inbox.DefaultCommitTimeout || ib.Config().CommitTimeout != inbox.DefaultCommitTimeout {
		t.Errorf("default commit timeouts: orchestrator %s, inbox %s; want %s", o.Config().CommitTimeout, ib.Config().CommitTimeout, inbox.DefaultCommitTimeout)
	}
	if _, err := saga.NewParticipant(saga.ParticipantConfig{Pool: w.db.Pool, Schema: w.db.Schema, Consumer: "p", CommitTimeout: -time.Second}); err == nil {
		t.Error("a negative CommitTimeout was accepted")
	}
}
