// Command orders is the example shop's orders service: an HTTP API whose POST /orders is made
// idempotent by the Idempotency-Key middleware, and the checkout saga's orchestrator.
//
// One transaction per order holds the order row, the stored HTTP response, the OrderCreated
// event, the order's reminder (scheduled: outbox.DeliverAfter) and the saga's start (its local
// first step and its first command, in the outbox). The relay publishes them, the reminder when
// it is due; inventory and payments answer the saga's commands; this service confirms or
// cancels the order in the saga's own transitions (local steps), withdraws a cancelled order's
// reminder there (outbox's Writer.CancelTx), and publishes the outcome for read models
// (examples/projection).
//
//	go run ./examples/orders -addr 127.0.0.1:8080
//
// With DATABASE_URL and KAFKA_BROKERS unset it starts an embedded PostgreSQL and Kafka and
// says so. See README.md.
package main

import (
	"context"
	"flag"
	"log/slog"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/examples/internal/checkout"
	"github.com/onceflow/onceflow/examples/internal/platform"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

// ddl is the service's own table, next to onceflow's in the same schema.
const ddl = `
CREATE TABLE IF NOT EXISTS orders (
	id              uuid PRIMARY KEY,
	customer_id     text NOT NULL,
	idempotency_key text NOT NULL, -- kept for support; the middleware makes one order per key
	sku             text NOT NULL,
	quantity        int NOT NULL CHECK (quantity > 0),
	amount          bigint NOT NULL,
	status          text NOT NULL DEFAULT 'pending', -- pending, confirmed, cancelled
	reason          text NOT NULL DEFAULT '',        -- why it was cancelled
	version         int NOT NULL DEFAULT 1,          -- bumped by every change, sent with the events
	created_at      timestamptz NOT NULL DEFAULT now(),
	updated_at      timestamptz NOT NULL DEFAULT now(),
	reminder_id     uuid,                            -- the scheduled OrderReminder's event id, to withdraw it
	reminder        text,                            -- scheduled; withdrawn or too late once cancelled; NULL: none
	reminder_cancel timestamptz                      -- when the cancellation withdrew it or found it gone
);
-- Tables created before the reminders: their orders have none.
ALTER TABLE orders ADD COLUMN IF NOT EXISTS reminder_id uuid;
ALTER TABLE orders ADD COLUMN IF NOT EXISTS reminder text;
ALTER TABLE orders ADD COLUMN IF NOT EXISTS reminder_cancel timestamptz`

func main() {
	f := platform.RegisterFlags("127.0.0.1:8080", "orders")
	waitInFlight := flag.Duration("wait-in-flight", 2*time.Second, "how long a retry of a request still running waits for its answer (0: answer 409 at once)")
	remindAfter := flag.Duration("remind-after", time.Minute, "when an order's reminder is due, after the order (a real shop: a day)")
	platform.Main("orders", f, func(ctx context.Context, log *slog.Logger) error {
		return run(ctx, f, *waitInFlight, *remindAfter, log)
	})
}

// service holds what the handlers need.
type service struct {
	pool     *pgxpool.Pool
	writer   *outbox.Writer // the outbox of this service's schema
	topics   checkout.Topics
	checkout *saga.Definition[Checkout]
	orch     *saga.Orchestrator
	admin    *saga.Admin
	counters *platform.Counter
	// remindAfter is how long after its order an OrderReminder is due.
	remindAfter time.Duration
}

func run(ctx context.Context, f *platform.Flags, waitInFlight, remindAfter time.Duration, log *slog.Logger) error {
	infra, err := platform.StartInfra(ctx, log)
	if err != nil {
		return err
	}
	defer infra.Close()
	pool, err := platform.OpenSchema(ctx, infra.DatabaseURL, f.Schema, ddl, 24)
	if err != nil {
		return err
	}
	defer pool.Close()
	topics := checkout.NewTopics(f.TopicPrefix)
	if err := platform.CreateTopics(ctx, infra.Brokers, topics.All()...); err != nil {
		return err
	}

	s := &service{pool: pool, topics: topics, counters: &platform.Counter{}, remindAfter: remindAfter}
	s.checkout = checkoutSaga(topics, s) // its local steps use the service's writer and tables
	if s.writer, err = outbox.NewWriter(outbox.Config{Schema: f.Schema}); err != nil {
		return err
	}
	if s.admin, err = saga.NewAdmin(f.Schema); err != nil {
		return err
	}
	sagaCounters := &saga.Counters{}
	s.orch, err = saga.NewOrchestrator(saga.OrchestratorConfig{Pool: pool, Schema: f.Schema, Writer: s.writer,
		Logger: log, Metrics: sagaCounters})
	if err != nil {
		return err
	}
	// New orders start on version 2 (local steps). Version 1 stays registered so that sagas
	// started on it before an upgrade still finish on it (every saga runs to its end on the
	// definition it started with).
	if err := saga.Register(s.orch, s.checkout); err != nil {
		return err
	}
	if err := saga.Register(s.orch, checkoutSagaV1(topics)); err != nil {
		return err
	}
	// Version 1 only: the orders service was a participant of its own saga (place, confirm,
	// cancel as commands to itself). Version 2 sends none of them, but a version-1 saga in
	// flight still does, so its participant and the three consumers below stay registered
	// until `onceflow saga list --name checkout` shows no version-1 saga running. Then remove
	// them with checkoutSagaV1.
	part, err := saga.NewParticipant(saga.ParticipantConfig{Pool: pool, Schema: f.Schema, Consumer: "orders",
		Writer: s.writer, Logger: log, Metrics: sagaCounters})
	if err != nil {
		return err
	}

	router, err := platform.NewRouter(log)
	if err != nil {
		return err
	}
	// The orchestrator deduplicates replies itself: no inbox middleware in front of it.
	// Deliveries are counted so that `make demo` can show how many were duplicates.
	if err := f.Consume(router, infra.Brokers, log, "orders.orchestrator", topics.Replies,
		platform.Count(s.counters, "replies_delivered", s.orch.Handler)); err != nil {
		return err
	}
	// Version 1's self-sent commands (see above).
	if err := f.Consume(router, infra.Brokers, log, "orders.place", topics.PlaceOrder, saga.Action(part, s.place)); err != nil {
		return err
	}
	if err := f.Consume(router, infra.Brokers, log, "orders.confirm", topics.ConfirmOrder, saga.Action(part, s.confirm)); err != nil {
		return err
	}
	if err := f.Consume(router, infra.Brokers, log, "orders.cancel", topics.CancelOrder, saga.Compensation(part, s.cancel)); err != nil {
		return err
	}

	mw, err := idempotency.New(idempotency.Config{
		Pool:   pool,
		Schema: f.Schema,
		// The owner scopes the keys. X-Customer-ID stands in for authentication here; a real
		// service takes the principal its auth middleware established.
		Owner:   customerID,
		Metrics: platform.HTTPMetrics{C: s.counters},
		// A retry that arrives while the first request is still running waits for its
		// response instead of getting 409 at once.
		WaitInFlight: waitInFlight,
	})
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw.Require(http.HandlerFunc(s.createOrder)))
	mux.HandleFunc("GET /orders/{id}", s.getOrder)
	platform.HandleOps(mux, func() map[string]int64 {
		c := s.counters.Snapshot()
		snap := sagaCounters.Snapshot()
		c["sagas_started"], c["sagas_completed"], c["sagas_compensated"] = snap.Started, snap.Completed, snap.Compensated
		c["sagas_stuck"], c["saga_events_ignored"] = snap.Stuck, snap.Ignored
		c["local_steps"], c["local_step_failures"] = snap.LocalRuns, snap.LocalFailures
		c["barrier_duplicates"], c["null_compensations"], c["hanging_actions"] = snap.Duplicates, snap.NullCompensations, snap.HangingActions
		return c
	})

	parts := []func(context.Context) error{
		router.Run,
		s.orch.Run, // fires the saga's durable timers
		func(ctx context.Context) error {
			if err := platform.WaitRunning(ctx, router); err != nil {
				return nil
			}
			return platform.Serve(ctx, f.Addr, mux, log)
		},
	}
	if f.Relay {
		parts = append(parts, func(ctx context.Context) error { return platform.RunRelay(ctx, pool, f.Schema, infra.Brokers, log) })
	}
	return platform.Run(ctx, parts...)
}

// customerID is the idempotency middleware's Owner: who the request acts for.
func customerID(r *http.Request) (string, error) {
	if id := r.Header.Get("X-Customer-ID"); id != "" {
		return id, nil
	}
	return "", idempotency.ErrNoOwner // answered 401 problem+json
}
