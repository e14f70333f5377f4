package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/outbox"
)

// The same message delivered 5 times in a row: the effect is applied once and the other 4
// deliveries are acknowledged as duplicates.
func TestDuplicateDeliveriesApplyOnce(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	var calls atomic.Int32
	h := f.ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return nil, f.applyEffect(msg, "")
	})
	msg := outbox.NewMessage([]byte(`{"order":1}`))
	for i := range 5 {
		out, err := h(msg.Copy())
		if err != nil || out != nil {
			t.Fatalf("delivery %d: out=%v err=%v", i+1, out, err)
		}
	}
	if n := f.effects(msg.UUID); n != 1 {
		t.Fatalf("effect applied %d times, want 1", n)
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1", n)
	}
	if s := snapshot(f); s.Processed != 1 || s.Duplicates != 4 || s.Failures != 0 {
		t.Fatalf("metrics %+v, want 1 processed, 4 duplicates", s)
	}
	var consumer, key string
	if err := f.db.Pool.QueryRow(context.Background(), `SELECT consumer, dedup_key FROM `+f.db.Table("processed_event")).Scan(&consumer, &key); err != nil {
		t.Fatal(err)
	}
	if consumer != "billing" || key != "event:"+msg.UUID {
		t.Fatalf("dedup row (%q, %q), want (billing, event:%s)", consumer, key, msg.UUID)
	}
	// A second consumer of the same topic is independent: it applies the message once too.
	other := f.newInbox(func(c *inbox.Config) { c.Consumer = "shipping" })
	h2 := other.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, f.applyEffect(msg, "shipping") })
	for range 2 {
		if _, err := h2(msg.Copy()); err != nil {
			t.Fatal(err)
		}
	}
	if n := f.count(`SELECT count(*) FROM ` + f.db.Table("effect") + ` WHERE note = 'shipping'`); n != 1 {
		t.Fatalf("second consumer applied %d times, want 1", n)
	}
}

// Two goroutines handle the same message at once, as two consumers do during a rebalance:
// the second blocks on the first one's uncommitted dedup row, then skips (if the first
// committed) or runs the handler (if the first rolled back). Either way: one effect.
func TestConcurrentDeliveryWaitsThenSkips(t *testing.T) {
	t.Parallel()
	for _, firstFails := range []bool{false, true} {
		t.Run(fmt.Sprintf("first_fails=%v", firstFails), func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, nil)
			// Two inbox instances: two consumer processes of the same consumer group.
			a, b := f.ib, f.newInbox(nil)
			entered := make(chan struct{})
			release := make(chan struct{})
			var calls atomic.Int32
			handler := func(msg *message.Message) ([]*message.Message, error) {
				n := calls.Add(1)
				if err := f.applyEffect(msg, fmt.Sprint("call ", n)); err != nil {
					return nil, err
				}
				if n == 1 {
					close(entered)
					select {
					case <-release:
					case <-time.After(2 * time.Minute):
						return nil, errors.New("never released")
					}
					if firstFails {
						return nil, errors.New("first copy fails")
					}
				}
				return nil, nil
			}
			msg := outbox.NewMessage([]byte("x"))
			errA := make(chan error, 1)
			go func() { _, err := a.Middleware(handler)(msg.Copy()); errA <- err }()
			<-entered
			errB := make(chan error, 1)
			go func() { _, err := b.Middleware(handler)(msg.Copy()); errB <- err }()

			// The second copy is waiting on the first one's row lock, not running its handler.
			waitFor(t, "the second copy to wait on the dedup row lock", func() bool {
				return f.count(`SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
					AND query LIKE '%processed_event%' AND query LIKE '%' || $1 || '%'`, f.db.Schema) == 1
			})
			if n := calls.Load(); n != 1 {
				t.Fatalf("handler ran %d times while the first copy was in flight", n)
			}
			close(release)
			if err := <-errA; (err != nil) != firstFails {
				t.Fatalf("first copy: %v", err)
			}
			if err := <-errB; err != nil {
				t.Fatalf("second copy: %v", err)
			}
			if n := f.effects(msg.UUID); n != 1 {
				t.Fatalf("effect rows %d, want 1", n)
			}
			s := snapshot(f)
			if firstFails {
				if calls.Load() != 2 || s.Processed != 1 || s.Failures != 1 || s.Duplicates != 0 {
					t.Fatalf("calls %d, metrics %+v: want the second copy to run after the first rolled back", calls.Load(), s)
				}
				if n := f.count(`SELECT count(*) FROM ` + f.db.Table("effect") + ` WHERE note = 'call 2'`); n != 1 {
					t.Fatal("the surviving effect is not the second copy's")
				}
			} else if calls.Load() != 1 || s.Processed != 1 || s.Duplicates != 1 {
				t.Fatalf("calls %d, metrics %+v: want the second copy skipped as a duplicate", calls.Load(), s)
			}
			if n := f.dedupRows(); n != 1 {
				t.Fatalf("dedup rows %d, want 1", n)
			}
		})
	}
}

// Under Retry each attempt runs in a fresh transaction: failed attempts leave no dedup row and
// no effect, and the successful one applies the effect once.
func TestRetryFreshTransactionPerAttempt(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	var attempts atomic.Int32
	txids := map[int64]bool{}
	var mu sync.Mutex
	handler := func(failures int32) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			n := attempts.Add(1)
			tx := outbox.MustTx(msg.Context())
			var txid int64
			if err := tx.QueryRow(msg.Context(), `SELECT txid_current()`).Scan(&txid); err != nil {
				return nil, err
			}
			mu.Lock()
			txids[txid] = true
			mu.Unlock()
			// Seen from another connection, earlier failed attempts left nothing committed.
			if got := f.count(`SELECT count(*) FROM `+f.db.Table("processed_event")+` WHERE dedup_key = $1`, "event:"+msg.UUID) + f.effects(msg.UUID); got != 0 {
				return nil, fmt.Errorf("attempt %d sees %d committed rows from failed attempts", n, got)
			}
			if err := f.applyEffect(msg, ""); err != nil {
				return nil, err
			}
			if n <= failures {
				return nil, fmt.Errorf("attempt %d fails", n)
			}
			return nil, nil
		}
	}
	retry := middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond, ShouldRetry: inbox.ShouldRetry}
	msg := outbox.NewMessage([]byte("x"))
	if _, err := retry.Middleware(f.ib.Middleware(handler(2)))(msg); err != nil {
		t.Fatal(err)
	}
	if attempts.Load() != 3 || len(txids) != 3 {
		t.Fatalf("attempts %d in %d transactions, want 3 in 3", attempts.Load(), len(txids))
	}
	if f.effects(msg.UUID) != 1 || f.dedupRows() != 1 {
		t.Fatalf("effects %d dedup rows %d, want 1 and 1", f.effects(msg.UUID), f.dedupRows())
	}
	if s := snapshot(f); s.Processed != 1 || s.Failures != 2 {
		t.Fatalf("metrics %+v", s)
	}
	if msg.Context() != context.Background() {
		t.Fatal("the message context was not restored after the attempt")
	}

	// When every attempt fails, nothing is left behind, and the redelivery runs again.
	attempts.Store(0)
	clear(txids)
	retry.MaxRetries = 1
	msg2 := outbox.NewMessage([]byte("y"))
	if _, err := retry.Middleware(f.ib.Middleware(handler(5)))(msg2); err == nil || !strings.Contains(err.Error(), "attempt 2 fails") {
		t.Fatalf("err = %v, want the last attempt's error", err)
	}
	if f.effects(msg2.UUID) != 0 || f.dedupRows() != 1 {
		t.Fatal("failed attempts left rows behind")
	}
	attempts.Store(0)
	if _, err := f.ib.Middleware(handler(0))(msg2.Copy()); err != nil {
		t.Fatalf("redelivery: %v", err)
	}
	if f.effects(msg2.UUID) != 1 || f.dedupRows() != 2 {
		t.Fatal("redelivery after failures did not apply the effect")
	}
}

// A handler panic rolls everything back and keeps unwinding, so Recoverer (or the router)
// turns it into a failed message; the connection goes back to the pool.
func TestPanicRollsBack(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	msg := outbox.NewMessage([]byte("x"))
	h := f.ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if err := f.applyEffect(msg, ""); err != nil {
			return nil, err
		}
		panic("boom")
	})
	_, err := middleware.Recoverer(h)(msg)
	var rp middleware.RecoveredPanicError
	if !errors.As(err, &rp) || rp.V != "boom" {
		t.Fatalf("err = %v, want the recovered panic", err)
	}
	func() {
		defer func() {
			if r := recover(); r != "boom" {
				t.Fatalf("recovered %v, want the handler's panic to propagate", r)
			}
		}()
		_, _ = h(msg.Copy())
	}()
	if f.effects(msg.UUID) != 0 || f.dedupRows() != 0 {
		t.Fatal("a panicking handler left rows behind")
	}
	if s := snapshot(f); s.Failures != 2 || s.Processed != 0 {
		t.Fatalf("metrics %+v", s)
	}
	if n := f.db.Pool.Stat().AcquiredConns(); n != 0 {
		t.Fatalf("%d connections still acquired after the panics", n)
	}
	ok := f.ib.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, f.applyEffect(msg, "") })
	if _, err := ok(msg.Copy()); err != nil || f.effects(msg.UUID) != 1 {
		t.Fatalf("redelivery after the panic: %v, effects %d", err, f.effects(msg.UUID))
	}
}

type InvoiceRequested struct {
	OrderID int `json:"order_id"`
}

// Messages a handler returns, or publishes on an outbox event bus, are in the outbox if and
// only if the inbox transaction commits.
func TestHandlerEventsInOutboxIffCommitted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, nil)
	if _, err := f.db.Pool.Exec(ctx, `CREATE TABLE `+f.db.Table("deferred_check")+` (v int UNIQUE DEFERRABLE INITIALLY DEFERRED); INSERT INTO `+f.db.Table("deferred_check")+` VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	bus, err := cqrs.NewEventBusWithConfig(f.ib.Config().Writer.ContextPublisher(), cqrs.EventBusConfig{
		GeneratePublishTopic: func(p cqrs.GenerateEventPublishTopicParams) (string, error) { return "bus." + p.EventName, nil },
		Marshaler:            cqrs.JSONMarshaler{NewUUID: outbox.NewUUID},
	})
	if err != nil {
		t.Fatal(err)
	}
	// The handler's behaviour after emitting its events is chosen by the payload.
	var emitted []*message.Message
	h := f.ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if err := f.applyEffect(msg, ""); err != nil {
			return nil, err
		}
		if err := bus.Publish(msg.Context(), &InvoiceRequested{OrderID: 7}); err != nil {
			return nil, err
		}
		emitted = []*message.Message{
			outbox.ToTopic(outbox.SetPartitionKey(outbox.NewMessage([]byte("a1")), "order-7"), "topic.a"),
			outbox.ToTopic(outbox.NewMessage([]byte("a2")), "topic.a"),
			outbox.ToTopic(outbox.NewMessage([]byte("b1")), "topic.b"),
		}
		switch string(msg.Payload) {
		case "handler error":
			return emitted, errors.New("handler failed after emitting")
		case "commit fails":
			// Violates a deferred constraint: the error surfaces only at COMMIT.
			if _, err := outbox.MustTx(msg.Context()).Exec(msg.Context(), `INSERT INTO `+f.db.Table("deferred_check")+` VALUES (1)`); err != nil {
				return nil, err
			}
		case "invalid event":
			emitted = append(emitted, outbox.ToTopic(message.NewMessage("not-a-uuid", []byte("x")), "topic.a"))
		}
		return emitted, nil
	})

	for _, payload := range []string{"handler error", "commit fails", "invalid event"} {
		msg := outbox.NewMessage([]byte(payload))
		_, err := h(msg)
		if err == nil {
			t.Fatalf("%s: no error", payload)
		}
		if payload == "commit fails" && !strings.Contains(err.Error(), "commit") {
			t.Fatalf("%s: err = %v", payload, err)
		}
		if payload == "invalid event" && !inbox.IsPoison(err) {
			t.Fatalf("%s: err = %v is not permanent", payload, err)
		}
		if rows := f.outboxRows(); len(rows) != 0 || f.dedupRows() != 0 || f.effects(msg.UUID) != 0 {
			t.Fatalf("%s: rolled-back message left %d outbox rows, %d dedup rows, %d effects", payload, len(rows), f.dedupRows(), f.effects(msg.UUID))
		}
	}

	msg := outbox.NewMessage([]byte("ok"))
	if out, err := h(msg); err != nil || out != nil {
		t.Fatalf("out=%v err=%v", out, err)
	}
	rows := f.outboxRows()
	if len(rows) != 4 {
		t.Fatalf("outbox rows %d, want 4: %+v", len(rows), rows)
	}
	if rows[0].Topic != "bus.inbox_test.InvoiceRequested" || string(rows[0].Payload) != `{"order_id":7}` {
		t.Fatalf("event bus row = %+v", rows[0])
	}
	for i, want := range []struct{ topic, payload, key string }{{"topic.a", "a1", "order-7"}, {"topic.a", "a2", ""}, {"topic.b", "b1", ""}} {
		r := rows[i+1]
		if r.EventID != emitted[i].UUID || r.Topic != want.topic || string(r.Payload) != want.payload || r.Key != want.key {
			t.Errorf("row %d = %+v, want %+v with id %s", i+1, r, want, emitted[i].UUID)
		}
		if _, ok := r.Metadata[outbox.MetadataTopic]; ok {
			t.Errorf("row %d keeps the routing metadata: %v", i+1, r.Metadata)
		}
	}
	if _, ok := emitted[0].Metadata[outbox.MetadataTopic]; !ok {
		t.Error("the handler's own message was modified")
	}
	// A redelivery is a duplicate: no new outbox rows.
	if _, err := h(msg.Copy()); err != nil || len(f.outboxRows()) != 4 {
		t.Fatalf("duplicate wrote events again (err %v)", err)
	}
	// Without a publish topic and without ToTopic the handler's message has nowhere to go.
	noTopic := f.ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		return []*message.Message{outbox.NewMessage([]byte("lost?"))}, nil
	})
	if _, err := noTopic(outbox.NewMessage([]byte("x"))); !errors.Is(err, inbox.ErrNoTopic) || !inbox.IsPoison(err) {
		t.Fatalf("err = %v, want ErrNoTopic", err)
	}
	if len(f.outboxRows()) != 4 || f.dedupRows() != 1 {
		t.Fatal("a refused message changed the database")
	}
}

// Registered on a router with a publish topic, a handler's returned messages go to that topic
// through the outbox, and the router's publisher receives nothing.
func TestRouterPublishTopicThroughOutbox(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	logger := watermill.NopLogger{}
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, logger)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(f.ib.Middleware)
	router.AddHandler("billing", "orders", pubsub, "invoices", inbox.OutboxOnly{}, func(msg *message.Message) ([]*message.Message, error) {
		if err := f.applyEffect(msg, ""); err != nil {
			return nil, err
		}
		return []*message.Message{
			outbox.NewMessage([]byte("invoice")),
			outbox.ToTopic(outbox.NewMessage([]byte("mail")), "mails"),
		}, nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	<-router.Running()
	msg := outbox.NewMessage([]byte("order"))
	for range 2 {
		if err := pubsub.Publish("orders", msg.Copy()); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "both deliveries", func() bool { s := snapshot(f); return s.Processed+s.Duplicates == 2 })
	rows := f.outboxRows()
	if len(rows) != 2 || rows[0].Topic != "invoices" || rows[1].Topic != "mails" || f.effects(msg.UUID) != 1 {
		t.Fatalf("rows %+v, effects %d", rows, f.effects(msg.UUID))
	}
	if s := snapshot(f); s.Processed != 1 || s.Duplicates != 1 || s.Failures != 0 {
		t.Fatalf("metrics %+v (a failure would mean the router tried to publish)", s)
	}
}

func TestMustTxAndOutboxOnlyRefuseWithoutMiddleware(t *testing.T) {
	t.Parallel()
	func() {
		defer func() {
			if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "run the handler behind the inbox middleware") {
				t.Fatalf("recovered %v", r)
			}
		}()
		outbox.MustTx(context.Background())
	}()
	if err := (inbox.OutboxOnly{}).Publish("t", outbox.NewMessage(nil)); !errors.Is(err, inbox.ErrRouterPublish) {
		t.Fatalf("err = %v", err)
	}
}

// A saga step is deduplicated by saga id + step + phase, whatever its event id.
func TestSagaKeys(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	h := f.ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		return nil, f.applyEffect(msg, msg.Metadata.Get(outbox.MetadataSagaStep)+"/"+msg.Metadata.Get(outbox.MetadataSagaPhase))
	})
	saga := outbox.NewUUID()
	step := func(step, phase string) *message.Message {
		m := outbox.NewMessage([]byte("{}")) // a new event id every time, as a re-sent command would have
		m.Metadata.Set(outbox.MetadataSagaID, saga)
		m.Metadata.Set(outbox.MetadataSagaStep, step)
		if phase != "" {
			m.Metadata.Set(outbox.MetadataSagaPhase, phase)
		}
		return m
	}
	deliveries := []*message.Message{
		step("reserve", "action"),
		step("charge", "action"),        // same saga, different step: runs
		step("reserve", "action"),       // same step again: skipped
		step("reserve", ""),             // no phase means action: skipped
		step("reserve", "compensation"), // compensation of the same step: runs
		step("reserve", "compensation"), // twice: skipped
		outbox.SetSaga(step("reserve", ""), outbox.SagaRef{ID: saga, Step: "reserve", Attempt: 2}), // a deliberate re-send: runs
		outbox.SetSaga(step("reserve", ""), outbox.SagaRef{ID: saga, Step: "reserve", Attempt: 2}), // its duplicate: skipped
		outbox.SetSaga(step("reserve", ""), outbox.SagaRef{ID: saga, Step: "reserve", Attempt: 1}), // attempt 1 explicitly: skipped
	}
	for i, m := range deliveries {
		if _, err := h(m); err != nil {
			t.Fatalf("delivery %d: %v", i, err)
		}
	}
	got := map[string]int{}
	rows, _ := f.db.Pool.Query(context.Background(), `SELECT note FROM `+f.db.Table("effect"))
	notes, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range notes {
		got[n]++
	}
	want := map[string]int{"reserve/action": 2, "charge/action": 1, "reserve/compensation": 1}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("effects %v, want %v", got, want)
	}
	if s := snapshot(f); s.Processed != 4 || s.Duplicates != 5 {
		t.Fatalf("metrics %+v", s)
	}
	// Another saga with the same step names is a different key.
	saga = outbox.NewUUID()
	if _, err := h(step("reserve", "action")); err != nil || f.count(`SELECT count(*) FROM `+f.db.Table("effect")) != 5 {
		t.Fatalf("step of another saga: err %v", err)
	}
}

// A message without a usable key never reaches the handler: by default it is returned as a
// permanent error (for the poison queue); with DropNoKey it is acknowledged and counted.
func TestNoKeyPolicy(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	var calls atomic.Int32
	handler := func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return nil, f.applyEffect(msg, "")
	}
	sagaNoStep := outbox.NewMessage([]byte("x"))
	sagaNoStep.Metadata.Set(outbox.MetadataSagaID, "s-1")
	keyless := []*message.Message{message.NewMessage("", []byte("x")), sagaNoStep}

	for _, m := range keyless {
		_, err := f.ib.Middleware(handler)(m)
		if !errors.Is(err, inbox.ErrNoKey) || !inbox.IsPoison(err) || inbox.ShouldRetry(middleware.RetryParams{Err: err}) {
			t.Fatalf("err = %v, want a permanent ErrNoKey", err)
		}
	}
	drop := f.newInbox(func(c *inbox.Config) { c.NoKeyPolicy = inbox.DropNoKey })
	for _, m := range keyless {
		if out, err := drop.Middleware(handler)(m); err != nil || out != nil {
			t.Fatalf("DropNoKey: out=%v err=%v", out, err)
		}
	}
	// A custom KeyFunc's error is a missing key too, and its key is checked like any other.
	custom := f.newInbox(func(c *inbox.Config) {
		c.KeyFunc = func(msg *message.Message) (string, error) {
			if len(msg.Payload) == 0 {
				return "", errors.New("no order id in payload")
			}
			return string(msg.Payload), nil
		}
	})
	if _, err := custom.Middleware(handler)(outbox.NewMessage([]byte{})); !errors.Is(err, inbox.ErrNoKey) || !strings.Contains(err.Error(), "no order id") {
		t.Fatalf("err = %v", err)
	}
	if _, err := custom.Middleware(handler)(outbox.NewMessage([]byte("a\x00b"))); !errors.Is(err, inbox.ErrNoKey) {
		t.Fatalf("NUL key: err = %v", err)
	}
	if calls.Load() != 0 || f.dedupRows() != 0 {
		t.Fatalf("handler ran %d times / %d dedup rows for keyless messages", calls.Load(), f.dedupRows())
	}
	if s := snapshot(f); s.NoKeys != 6 || s.Failures != 0 {
		t.Fatalf("metrics %+v", s)
	}
	// The custom key deduplicates by business id across different event ids.
	for range 3 {
		if _, err := custom.Middleware(handler)(outbox.NewMessage([]byte("order-1"))); err != nil {
			t.Fatal(err)
		}
	}
	if calls.Load() != 1 || f.count(`SELECT count(*) FROM `+f.db.Table("processed_event")+` WHERE dedup_key = 'order-1'`) != 1 {
		t.Fatalf("custom key: %d calls", calls.Load())
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	_, err := inbox.New(inbox.Config{Schema: "Bad-Schema", NoKeyPolicy: 7})
	for _, want := range []string{"Pool is nil", "invalid schema name", "Consumer is empty", "NoKeyPolicy is NoKeyPolicy(7)"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error %v does not report %q", err, want)
		}
	}
	_, err = inbox.New(inbox.Config{Consumer: strings.Repeat("c", inbox.MaxConsumerBytes+1)})
	if err == nil || !strings.Contains(err.Error(), "at most 200") {
		t.Errorf("long consumer: %v", err)
	}
}

// The handler must not end the inbox transaction. A handler written in the usual pgx style
// (commit at the end, defer a rollback) would otherwise commit the dedup row and its effect
// without the messages it returns — the middleware could no longer write them, the message
// would be nacked, and its redelivery skipped as a duplicate: the events lost for good. Or its
// deferred rollback would undo every attempt, so the message could never be processed.
func TestHandlerCannotEndTheTransaction(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	leaked := make(chan pgx.Tx, 1)
	h := f.ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx := outbox.MustTx(ctx)
		defer tx.Rollback(ctx) // the pgx idiom for a transaction one owns: must change nothing
		if err := f.applyEffect(msg, ""); err != nil {
			return nil, err
		}
		// Savepoints are the handler's to end.
		if err := pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error { return f.applyEffect(msg, "savepoint") }); err != nil {
			return nil, err
		}
		if err := tx.Commit(ctx); !errors.Is(err, outbox.ErrTxManaged) {
			t.Errorf("Commit = %v; want ErrTxManaged", err)
		}
		if err := tx.Rollback(ctx); !errors.Is(err, outbox.ErrTxManaged) {
			t.Errorf("Rollback = %v; want ErrTxManaged", err)
		}
		select {
		case leaked <- tx:
		default:
		}
		return []*message.Message{outbox.ToTopic(outbox.NewMessage([]byte("event")), "events")}, nil
	})
	msg := outbox.NewMessage([]byte("x"))
	for i := range 2 {
		if _, err := h(msg.Copy()); err != nil {
			t.Errorf("delivery %d: %v", i+1, err)
		}
	}
	if n, rows := f.effects(msg.UUID), f.outboxRows(); n != 2 || len(rows) != 1 || f.dedupRows() != 1 {
		t.Fatalf("%d effect rows, %d outbox rows, %d dedup rows; want the effect and its savepoint, one event, one dedup row", n, len(rows), f.dedupRows())
	}
	// A reference kept past the handler's return cannot write on the pooled connection.
	tx := <-leaked
	if _, err := tx.Exec(context.Background(), `INSERT INTO `+f.db.Table("effect")+` (msg_uuid) VALUES ('late')`); !errors.Is(err, pgx.ErrTxClosed) {
		t.Fatalf("Exec on a leaked transaction = %v; want ErrTxClosed", err)
	}
}
