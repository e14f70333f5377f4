package saga_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

// unmigrated returns a schema without any table, and one with every step before the saga
// migration (0004): the two ways a saga service meets a database it cannot use.
func unmigrated(t *testing.T) map[string]*testdb.DB {
	t.Helper()
	before := testdb.NewEmpty(t)
	if _, err := before.Pool.Exec(context.Background(), "CREATE SCHEMA "+before.Schema); err != nil {
		t.Fatal(err)
	}
	for _, m := range migrations.All() {
		if m.Version >= 4 {
			break
		}
		if _, err := before.Pool.Exec(context.Background(), m.SQL(before.Schema)); err != nil {
			t.Fatalf("apply %04d_%s: %v", m.Version, m.Name, err)
		}
	}
	return map[string]*testdb.DB{"empty": testdb.NewEmpty(t), "without the saga step": before}
}

// sagaMessage is a command or reply with valid saga metadata.
func sagaMessage(phase outbox.SagaPhase) *message.Message {
	msg := outbox.NewMessage([]byte(`{"order":"o-1"}`))
	outbox.SetSaga(msg, outbox.SagaRef{ID: "o-1", Step: "reserve", Phase: phase, Attempt: 1})
	msg.Metadata.Set(outbox.MetadataSagaName, "checkout")
	msg.Metadata.Set(outbox.MetadataSagaReplyTo, "checkout.replies")
	msg.Metadata.Set(outbox.MetadataSagaOutcome, outbox.SagaOutcomeDone)
	return msg
}

// On a schema without the saga tables every saga entry point that needs them fails with an
// error that matches migrations.ErrNotMigrated and names the command to run.
func TestUnmigratedSchemaErrors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, db := range unmigrated(t) {
		t.Run(name, func(t *testing.T) {
			def := checkoutDef(t, nil)
			orch, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: db.Pool, Schema: db.Schema, Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				t.Fatal(err)
			}
			if err := saga.Register(orch, def); err != nil {
				t.Fatal(err)
			}
			p, err := saga.NewParticipant(saga.ParticipantConfig{Pool: db.Pool, Schema: db.Schema, Consumer: "inventory"})
			if err != nil {
				t.Fatal(err)
			}
			w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
			if err != nil {
				t.Fatal(err)
			}
			admin, err := saga.NewAdmin(db.Schema)
			if err != nil {
				t.Fatal(err)
			}
			action := saga.Action(p, func(context.Context, pgx.Tx, stepCmd) (stepResult, error) { return stepResult{ID: "r"}, nil })
			compensation := saga.Compensation(p, func(context.Context, pgx.Tx, stepCmd) error { return nil })
			calls := map[string]func() error{
				"StartTx": func() error {
					return pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
						_, err := saga.StartTx(ctx, tx, def, Checkout{Order: "o-1"}, saga.WithID("o-1"), saga.WithWriter(w))
						return err
					})
				},
				"Orchestrator.Handler":     func() error { return orch.Handler(sagaMessage(outbox.SagaPhaseAction)) },
				"Orchestrator.FireDue":     func() error { _, err := orch.FireDue(ctx); return err },
				"Orchestrator.CheckSchema": func() error { return orch.CheckSchema(ctx) },
				"Action":                   func() error { return action(sagaMessage(outbox.SagaPhaseAction)) },
				"Compensation":             func() error { return compensation(sagaMessage(outbox.SagaPhaseCompensation)) },
				"Participant.CheckSchema":  func() error { return p.CheckSchema(ctx) },
				"Admin.Get":                func() error { _, err := admin.Get(ctx, db.Pool, "o-1"); return err },
				"Admin.List":               func() error { _, err := admin.List(ctx, db.Pool, saga.ListFilter{}); return err },
				"Cleaner.Clean": func() error {
					c, err := saga.NewCleaner(saga.CleanerConfig{Pool: db.Pool, Schema: db.Schema})
					if err != nil {
						return err
					}
					_, err = c.Clean(ctx)
					return err
				},
				"Admin.RetryTx": func() error {
					return pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return admin.RetryTx(ctx, tx, "o-1") })
				},
			}
			for call, f := range calls {
				err := f()
				if !errors.Is(err, migrations.ErrNotMigrated) || !strings.Contains(err.Error(), "onceflow migrate up --schema "+db.Schema) {
					t.Errorf("%s on a schema %s: %v; want an error matching migrations.ErrNotMigrated that names `onceflow migrate up --schema %s`",
						call, name, err, db.Schema)
				}
			}
		})
	}
}

// recorder is a slog.Handler that keeps the records it is given.
type recorder struct {
	mu      sync.Mutex
	records []slog.Record
	added   chan struct{}
}

func newRecorder() *recorder { return &recorder{added: make(chan struct{}, 1000)} }

func (r *recorder) Enabled(context.Context, slog.Level) bool { return true }
func (r *recorder) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	r.records = append(r.records, rec.Clone())
	r.mu.Unlock()
	select {
	case r.added <- struct{}{}:
	default:
	}
	return nil
}
func (r *recorder) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *recorder) WithGroup(string) slog.Handler      { return r }

func (r *recorder) snapshot() []slog.Record {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]slog.Record(nil), r.records...)
}

// waitFor waits until cond holds for the records logged so far.
func (r *recorder) waitFor(t *testing.T, what string, cond func([]slog.Record) bool) []slog.Record {
	t.Helper()
	deadline := time.After(60 * time.Second)
	for {
		if recs := r.snapshot(); cond(recs) {
			return recs
		}
		select {
		case <-r.added:
		case <-deadline:
			t.Fatalf("waited a minute for %s; logged:\n%s", what, dump(r.snapshot()))
		}
	}
}

func dump(recs []slog.Record) string {
	var b strings.Builder
	for _, rec := range recs {
		b.WriteString(rec.Time.Format("15:04:05.000") + " " + rec.Level.String() + " " + rec.Message)
		rec.Attrs(func(a slog.Attr) bool { b.WriteString(" " + a.String()); return true })
		b.WriteString("\n")
	}
	return b.String()
}

func attr(rec slog.Record, key string) slog.Value {
	var v slog.Value
	rec.Attrs(func(a slog.Attr) bool {
		if a.Key == key {
			v = a.Value
			return false
		}
		return true
	})
	return v
}

// Run on an unmigrated schema logs one line per failed round, naming the command to run,
// and waits twice as long after each (no "batch" fallback: no batch was claimed); once the
// schema is migrated it says so and fires timers again.
func TestRunBacksOffOnDatabaseErrors(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	db := testdb.NewEmpty(t)
	if _, err := db.Pool.Exec(ctx, "CREATE SCHEMA "+db.Schema); err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	interval := 10 * time.Millisecond
	orch, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: db.Pool, Schema: db.Schema, TimerInterval: interval, Logger: slog.New(rec)})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- orch.Run(ctx) }()

	const rounds = 5
	// The timer rounds' lines; Run's heartbeat (saga_orchestrator, registry.go) logs its own
	// failures beside them.
	timerLines := func(recs []slog.Record) []slog.Record {
		var out []slog.Record
		for _, r := range recs {
			if !strings.Contains(r.Message, "saga_orchestrator") {
				out = append(out, r)
			}
		}
		return out
	}
	recs := timerLines(rec.waitFor(t, "5 failed rounds", func(recs []slog.Record) bool { return len(timerLines(recs)) >= rounds }))
	want := interval
	for i, r := range recs[:rounds] {
		errText := attr(r, "err").String()
		if r.Level != slog.LevelError || !strings.Contains(errText, "onceflow migrate up --schema "+db.Schema) {
			t.Errorf("line %d: %s %q err=%q; want one error line per round naming `onceflow migrate up`", i+1, r.Level, r.Message, errText)
		}
		if got := attr(r, "retry_in"); got.Kind() != slog.KindDuration || got.Duration() != want {
			t.Errorf("line %d: retry_in=%v, want %s (doubling from TimerInterval)\n%s", i+1, got, want, dump(recs))
		}
		if i > 0 {
			// A lower bound only: Run waited at least the backoff it announced.
			if gap := r.Time.Sub(recs[i-1].Time); gap < want/2 {
				t.Errorf("line %d came %s after the previous one, announced wait %s", i+1, gap, want/2)
			}
		}
		want *= 2
	}
	for _, r := range recs {
		if strings.Contains(r.Message, "one at a time") {
			t.Errorf("Run logged %q though no batch of timers was claimed", r.Message)
		}
	}

	if _, err := migrations.Up(ctx, db.Pool, migrations.Options{Schema: db.Schema}); err != nil {
		t.Fatal(err)
	}
	rec.waitFor(t, "the recovery line", func(recs []slog.Record) bool {
		for _, r := range recs {
			if r.Level == slog.LevelInfo && strings.Contains(r.Message, "works again") {
				return true
			}
		}
		return false
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run returned %v after its context ended; want nil", err)
	}
}
