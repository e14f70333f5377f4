package saga_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

// replyTxDef is the checkout whose reserve step's reply handler runs in the transition's
// transaction (OnReplyTx).
func replyTxDef(t *testing.T, h saga.ReplyTxFunc[Checkout]) *saga.Definition[Checkout] {
	var steps []*saga.StepDef[Checkout]
	for _, name := range stepNames {
		s := saga.Step[Checkout](name).Send("cmd."+name, cmdOf).Compensate("undo."+name, cmdOf).Attempts(3, 10*time.Millisecond)
		if name == "reserve" {
			s.OnReplyTx(h)
		}
		steps = append(steps, s)
	}
	def, err := saga.Define("checkout", 1, steps)
	if err != nil {
		t.Fatal(err)
	}
	return def
}

// An OnReplyTx handler that hits a lock timeout (another transaction holds the row it
// updates) fails the transition, not the step: the reply is applied again once the lock is
// released, and the saga completes. It used to compensate the step on the first occurrence.
func TestLockTimeoutInOnReplyTxDoesNotCompensate(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		var w *world
		var calls atomic.Int32
		locked := make(chan struct{})
		def := replyTxDef(t, func(ctx context.Context, tx pgx.Tx, c *Checkout, r saga.Reply) error {
			if calls.Add(1) == 1 {
				close(locked) // the test holds the row's lock until this attempt timed out
			}
			if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '100ms'`); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `UPDATE `+w.db.Schema+`.stock SET reserved = reserved + 1 WHERE sku = 1`)
			return err
		})
		w = newWorldMode(t, batched, def)
		ctx := context.Background()
		if _, err := w.db.Pool.Exec(ctx, `CREATE TABLE `+w.db.Schema+`.stock (sku int PRIMARY KEY, reserved int NOT NULL); INSERT INTO `+w.db.Schema+`.stock VALUES (1, 0)`); err != nil {
			t.Fatal(err)
		}
		holder, err := w.db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := holder.Exec(ctx, `UPDATE `+w.db.Schema+`.stock SET reserved = reserved WHERE sku = 1`); err != nil {
			t.Fatal(err)
		}
		go func() {
			<-locked
			time.Sleep(300 * time.Millisecond) // past the handler's lock_timeout
			_ = holder.Rollback(context.Background())
		}()
		id := w.start("o-1")
		d := w.runUntil(id, saga.StateCompleted, saga.StateCompensated, saga.StateStuck)
		if got := w.effects(id); d.State != saga.StateCompleted || !slices.Equal(got, []string{"reserve/action", "charge/action", "confirm/action"}) {
			t.Fatalf("saga %s (%q), effects %v: a lock timeout must not compensate the step", d.State, d.Error, got)
		}
		if n := w.count(`SELECT reserved FROM ` + w.db.Schema + `.stock WHERE sku = 1`); n != 1 || calls.Load() < 2 {
			t.Fatalf("reserved %d (want 1) after %d calls (want ≥ 2)", n, calls.Load())
		}
	})
}

// 200 replies for steps with an OnReplyTx handler (a savepoint each) in one batch: no
// transaction takes more than 60 savepoints (PostgreSQL's per-backend subtransaction cache
// holds 64), every reply is applied once.
func TestOnReplyTxBatchStaysUnderTheSavepointCap(t *testing.T) {
	t.Parallel()
	var w *world
	def := replyTxDef(t, func(ctx context.Context, tx pgx.Tx, c *Checkout, _ saga.Reply) error {
		// Inside the handler's savepoint, pg_current_xact_id() is the top-level transaction's.
		_, err := tx.Exec(ctx, `INSERT INTO `+w.db.Schema+`.reply_tx (saga, xact) VALUES ($1, pg_current_xact_id()::text)`, c.Order)
		return err
	})
	w = newWorldMode(t, true, def, "reserve")
	ctx := context.Background()
	if _, err := w.db.Pool.Exec(ctx, `CREATE TABLE `+w.db.Schema+`.reply_tx (saga text NOT NULL, xact text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	const n = 200
	var msgs []*message.Message
	for i := range n {
		id := w.start(fmt.Sprintf("o-%03d", i))
		reply := outbox.SetSaga(outbox.NewMessage([]byte(`{"id":"r"}`)), outbox.SagaRef{ID: id, Step: "reserve", Phase: outbox.SagaPhaseAction, Attempt: 1})
		reply.Metadata.Set(outbox.MetadataSagaName, "checkout")
		reply.Metadata.Set(outbox.MetadataSagaOutcome, outbox.SagaOutcomeDone)
		reply.SetContext(ctx)
		msgs = append(msgs, reply)
	}
	if err := w.orch.ProcessBatch(ctx, msgs); err != nil {
		t.Fatal(err)
	}
	if got := w.count(`SELECT count(DISTINCT saga) FROM ` + w.db.Schema + `.reply_tx`); got != n {
		t.Fatalf("%d replies applied, want %d", got, n)
	}
	if most := w.count(`SELECT max(c) FROM (SELECT count(*) AS c FROM ` + w.db.Schema + `.reply_tx GROUP BY xact) s`); most > 60 {
		t.Fatalf("one transaction took %d OnReplyTx savepoints, over the cap of 60", most)
	}
}

// PostgreSQL restarted (immediate: connections cut mid-statement, then crash recovery)
// twice in a row while 200 sagas run through the relay and Kafka, per message and batched: no saga is
// stuck or compensated — an outage is nobody's failed attempt.
func TestPostgresRestartLeavesNoSagaStuck(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		srv, db := testdb.NewServer(t)
		w := newWorldOn(t, db, batched, checkoutDef(t, func(_ string, s *saga.StepDef[Checkout]) { s.Timeout(30 * time.Second) }))
		const sagas = 200
		ids := make([]string, sagas)
		for i := range ids {
			ids[i] = fmt.Sprintf("o-%03d", i)
		}
		var writers sync.WaitGroup
		for g := range 4 {
			writers.Go(func() {
				for i := g; i < sagas; i += 4 {
					w.start(ids[i])
				}
			})
		}
		writers.Wait()
		// The relay, the orchestrator and the participants start only now, with every saga
		// written: started before, they could finish the sagas as fast as the writers start
		// them, and the restart would find nothing in flight.
		stop := w.throughKafka(kafkatest.Brokers(t, 4))
		defer stop()
		// The test's own queries go through a connection of their own each time: a pooled one
		// from before a restart fails once, and that is the library's to handle, not the test's.
		count := func(sql string) (int, error) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			conn, err := pgx.Connect(ctx, db.URL)
			if err != nil {
				return 0, err
			}
			defer func() { _ = conn.Close(context.Background()) }()
			var n int
			return n, conn.QueryRow(ctx, sql).Scan(&n)
		}
		// Restart when an eighth of the sagas completed, and again as soon as the server is
		// back (immediate restarts in a row, as a crash loop or a failover and its failback).
		deadline := time.Now().Add(time.Minute)
		done := 0
		for time.Now().Before(deadline) {
			if n, err := count(`SELECT count(*) FROM ` + db.Schema + `.saga WHERE state = 'completed'`); err == nil && n >= sagas/8 {
				done = n
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		if done == sagas {
			t.Fatalf("every saga completed before the restart: nothing was in flight")
		}
		for range 2 {
			if err := srv.Restart(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
		t.Logf("restarted PostgreSQL twice with %d of %d sagas completed", done, sagas)
		deadline = time.Now().Add(3 * time.Minute)
		for {
			n, err := count(`SELECT count(*) FROM ` + db.Schema + `.saga WHERE state IN ('running', 'compensating')`)
			if err == nil && n == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%d sagas still running 3 minutes after the restarts (%v)", n, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
		for _, state := range []saga.State{saga.StateStuck, saga.StateCompensated} {
			if n, err := count(`SELECT count(*) FROM ` + db.Schema + `.saga WHERE state = '` + string(state) + `'`); err != nil || n != 0 {
				t.Errorf("%d sagas %s after the restarts (%v)", n, state, err)
			}
		}
		if n, err := count(`SELECT count(*) FROM ` + db.Schema + `.saga WHERE state = 'completed'`); err != nil || n != sagas {
			t.Errorf("%d of %d sagas completed (%v)", n, sagas, err)
		}
	})
}
