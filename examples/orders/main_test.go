package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/examples/internal/checkout"
	"github.com/onceflow/onceflow/examples/internal/exampletest"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

func TestMain(m *testing.M) { onceflowtest.Main(m) }

// The service as it runs: a process on its own schema that takes one order, answers a retry
// with the stored response, shows the order to its owner only, publishes the order's reminder
// when it is due and not before, and stops on SIGTERM.
func TestServesAnOrderAndStops(t *testing.T) {
	s := exampletest.Start(t, "github.com/onceflow/onceflow/examples/orders", "-remind-after", "2s")
	body := `{"sku":"book","quantity":2}`
	status, hdr, resp := s.Do(t, http.MethodPost, "/orders", body, "X-Customer-ID", "alice", "Idempotency-Key", "k-1")
	if status != http.StatusCreated {
		t.Fatalf("POST /orders: %d %s", status, resp)
	}
	var o struct{ ID, SKU, Status string }
	if err := json.Unmarshal([]byte(resp), &o); err != nil || o.ID == "" || o.Status != "pending" || hdr.Get("Location") != "/orders/"+o.ID {
		t.Fatalf("POST /orders: %s (Location %q), err %v", resp, hdr.Get("Location"), err)
	}
	status, hdr, again := s.Do(t, http.MethodPost, "/orders", body, "X-Customer-ID", "alice", "Idempotency-Key", "k-1")
	if status != http.StatusCreated || again != resp || hdr.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry: %d %s (replayed %q), want the first response", status, again, hdr.Get("Idempotent-Replayed"))
	}
	for _, c := range []struct {
		customer string
		want     int
	}{{"alice", http.StatusOK}, {"bob", http.StatusNotFound}} {
		if status, _, b := s.Do(t, http.MethodGet, "/orders/"+o.ID, "", "X-Customer-ID", c.customer); status != c.want {
			t.Errorf("GET as %s: %d %s, want %d", c.customer, status, b, c.want)
		}
	}
	if status, _, b := s.Do(t, http.MethodPost, "/orders", body, "Idempotency-Key", "k-2"); status != http.StatusUnauthorized {
		t.Errorf("POST without X-Customer-ID: %d %s, want 401", status, b)
	}

	// The reminder was written with the order, scheduled (outbox_scheduled, not the outbox),
	// and is published once due: 2 s after the order's transaction began.
	ctx := t.Context()
	var scheduled int
	var placedAt time.Time
	err := s.DB.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+s.Table("outbox_scheduled")+` q JOIN `+s.Table("orders")+` o
		ON o.reminder_id = q.event_id AND q.due_at = o.created_at + interval '2 seconds'), (SELECT created_at FROM `+s.Table("orders")+`)`).
		Scan(&scheduled, &placedAt)
	if err != nil || scheduled != 1 {
		t.Fatalf("%d reminders scheduled for the order (err %v), want 1, due 2s after it", scheduled, err)
	}
	rec := s.Await(t, checkout.NewTopics(s.Prefix).Reminders, map[string]string{"type": "OrderReminder"})
	var r checkout.OrderReminder
	if err := json.Unmarshal(rec.Value, &r); err != nil || r.OrderID != o.ID || r.CustomerID != "alice" || !r.DueAt.Equal(placedAt.Add(2*time.Second)) {
		t.Fatalf("reminder %s (err %v), want order %s of alice, due %s", rec.Value, err, o.ID, placedAt.Add(2*time.Second))
	}
	if early := r.DueAt.Sub(rec.Timestamp); early > 100*time.Millisecond { // the broker's clock is this machine's too
		t.Errorf("the reminder was published %s before it was due", early)
	}
	s.Stop(t)
}

// Sagas of both checkout versions finish in the service as it runs, each on the version it
// started with: version 2 (place-order, confirm and the cancel run as local steps) from
// POST /orders, and version 1 (those three sent as commands to the service itself) started
// in the service's schema as the service did before the upgrade — an in-flight saga of the
// older definition. The test plays inventory and payments: it answers their commands.
func TestFinishesSagasOfBothVersions(t *testing.T) {
	s := exampletest.Start(t, "github.com/onceflow/onceflow/examples/orders")
	topics := checkout.NewTopics(s.Prefix)
	ctx := t.Context()

	post := func(key, sku string) string {
		status, _, resp := s.Do(t, http.MethodPost, "/orders", `{"sku":"`+sku+`","quantity":1}`, "X-Customer-ID", "alice", "Idempotency-Key", key)
		var o struct{ ID string }
		if err := json.Unmarshal([]byte(resp), &o); status != http.StatusCreated || err != nil {
			t.Fatalf("POST /orders: %d %s (%v)", status, resp, err)
		}
		return o.ID
	}
	w, err := outbox.NewWriter(outbox.Config{Schema: s.Schema})
	if err != nil {
		t.Fatal(err)
	}
	startV1 := func(sku string) string {
		id := outbox.NewUUID()
		err := pgx.BeginFunc(ctx, s.DB.Pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO `+s.Table("orders")+` (id, customer_id, idempotency_key, sku, quantity, amount)
				VALUES ($1, 'bob', $2, $3, 1, 100)`, id, "key-"+id, sku); err != nil {
				return err
			}
			_, err := saga.StartTx(ctx, tx, checkoutSagaV1(topics),
				Checkout{OrderID: id, CustomerID: "bob", SKU: sku, Quantity: 1, Amount: 100}, saga.WithID(id), saga.WithWriter(w))
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	// answer waits for the saga's command on topic and replies with outcome, as a participant.
	answer := func(topic, id, outcome, reason string, result any) {
		t.Helper()
		cmd := s.Await(t, topic, map[string]string{outbox.MetadataSagaID: id})
		payload, err := json.Marshal(result)
		if err != nil {
			t.Fatal(err)
		}
		reply := outbox.SetPartitionKey(outbox.NewMessage(payload), id)
		for _, k := range []string{outbox.MetadataSagaID, outbox.MetadataSagaStep, outbox.MetadataSagaPhase, outbox.MetadataSagaAttempt, outbox.MetadataSagaName} {
			reply.Metadata.Set(k, exampletest.Header(cmd, k))
		}
		reply.Metadata.Set(outbox.MetadataSagaOutcome, outcome)
		if reason != "" {
			reply.Metadata.Set(outbox.MetadataSagaReason, reason)
		}
		s.Produce(t, exampletest.Header(cmd, outbox.MetadataSagaReplyTo), reply)
	}

	type want struct {
		id, status, reason string
		version            int
	}
	var wants []want
	for _, c := range []struct {
		version int
		confirm bool
	}{{2, true}, {2, false}, {1, true}, {1, false}} {
		var id string
		if c.version == 2 {
			id = post(fmt.Sprintf("k-%d-%t", c.version, c.confirm), "book")
		} else {
			id = startV1("book")
		}
		if c.confirm {
			answer(topics.Reserve, id, outbox.SagaOutcomeDone, "", checkout.Reserved{ReservationID: "r-" + id})
			answer(topics.Charge, id, outbox.SagaOutcomeDone, "", checkout.Charged{PaymentID: "p-" + id})
			wants = append(wants, want{id, "confirmed", "", c.version})
		} else {
			answer(topics.Reserve, id, outbox.SagaOutcomeFailed, "out of stock", struct{}{})
			wants = append(wants, want{id, "cancelled", `step "reserve-stock": failed: out of stock`, c.version})
		}
	}
	for _, w := range wants {
		var status, reason, state string
		var version int
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			err := s.DB.Pool.QueryRow(ctx, `SELECT o.status, o.reason, s.state, s.version FROM `+s.Table("orders")+` o
				JOIN `+s.Table("saga")+` s ON s.id = o.id::text WHERE o.id = $1`, w.id).Scan(&status, &reason, &state, &version)
			if err != nil {
				t.Fatal(err)
			}
			if status != "pending" && (state == "completed" || state == "compensated") || time.Now().After(deadline) {
				break
			}
		}
		if status != w.status || reason != w.reason || version != w.version {
			t.Errorf("order %s: %s (%q), saga version %d %s; want %s (%q), version %d", w.id, status, reason, version, state, w.status, w.reason, w.version)
		}
	}
	// Version 2's cancellation withdrew the order's reminder in its transaction (due in a
	// minute: still waiting); the confirmed order's is still scheduled. Version 1's orders were
	// written without one.
	for i, want := range []struct{ reminder, scheduled string }{{"scheduled", "1"}, {"withdrawn", "0"}, {"", "0"}, {"", "0"}} {
		var reminder, scheduled *string
		err := s.DB.Pool.QueryRow(ctx, `SELECT reminder, (SELECT count(*)::text FROM `+s.Table("outbox_scheduled")+` q WHERE q.event_id = o.reminder_id)
			FROM `+s.Table("orders")+` o WHERE id = $1`, wants[i].id).Scan(&reminder, &scheduled)
		if err != nil {
			t.Fatal(err)
		}
		if got := deref(reminder) + "/" + deref(scheduled); got != want.reminder+"/"+want.scheduled {
			t.Errorf("order %s (%s): reminder %s, want %s/%s", wants[i].id, wants[i].status, got, want.reminder, want.scheduled)
		}
	}
	// Version 1 confirmed through a command to the service itself; version 2 sent none.
	if r := s.Await(t, topics.ConfirmOrder, map[string]string{outbox.MetadataSagaID: wants[2].id}); r == nil {
		t.Error("no version-1 confirm command")
	}
	s.Stop(t)
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}
