// Command projection is a read model of the example shop: it applies the orders service's
// OrderCreated, OrderConfirmed and OrderCancelled events to an order_projection table, and
// records the orders' reminders (scheduled messages, published when due) in order_reminder,
// behind the inbox middleware (the dedup row and the writes commit in one transaction).
//
// It shows the two kinds of handler side by side:
//
//   - order_projection is naturally idempotent: each event carries the order's absolute state
//     and version, and the upsert only moves a row forward, so a redelivered (or late, older)
//     event changes nothing even without the dedup row;
//
//   - customer_orders counts orders per customer, a relative update (orders = orders + 1): a
//     redelivered OrderCreated would count twice, and only the inbox's dedup row stops it.
//
//     go run ./examples/projection -addr 127.0.0.1:8083
//
// With DATABASE_URL and KAFKA_BROKERS unset it starts an embedded PostgreSQL and Kafka and
// says so. See README.md.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/examples/internal/checkout"
	"github.com/onceflow/onceflow/examples/internal/platform"
	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/outbox"
)

const ddl = `
CREATE TABLE IF NOT EXISTS order_projection (
	order_id    text PRIMARY KEY,
	customer_id text NOT NULL,
	sku         text NOT NULL,
	quantity    int NOT NULL,
	amount      bigint NOT NULL,
	status      text NOT NULL,
	reason      text NOT NULL DEFAULT '',
	version     int NOT NULL,
	updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS customer_orders (
	customer_id text PRIMARY KEY,
	orders      int NOT NULL
);
CREATE TABLE IF NOT EXISTS order_reminder (
	order_id    text PRIMARY KEY,
	customer_id text NOT NULL,
	due_at      timestamptz NOT NULL,               -- when the orders service scheduled it for
	received_at timestamptz NOT NULL DEFAULT now(), -- when it was applied here
	reminders   int NOT NULL                        -- reminders sent for the order: relative, as customer_orders
)`

func main() {
	f := platform.RegisterFlags("127.0.0.1:8083", "projection")
	platform.Main("projection", f, func(ctx context.Context, log *slog.Logger) error { return run(ctx, f, log) })
}

func run(ctx context.Context, f *platform.Flags, log *slog.Logger) error {
	infra, err := platform.StartInfra(ctx, log)
	if err != nil {
		return err
	}
	defer infra.Close()
	pool, err := platform.OpenSchema(ctx, infra.DatabaseURL, f.Schema, ddl, 8)
	if err != nil {
		return err
	}
	defer pool.Close()
	topics := checkout.NewTopics(f.TopicPrefix)
	if err := platform.CreateTopics(ctx, infra.Brokers, topics.OrderEvents, topics.Reminders); err != nil {
		return err
	}

	counters := &inbox.Counters{}
	ib, err := inbox.New(inbox.Config{Pool: pool, Schema: f.Schema, Consumer: "projection", Logger: log, Metrics: counters})
	if err != nil {
		return err
	}
	if err := ib.CheckSchema(ctx); err != nil {
		return err
	}
	router, err := platform.NewRouter(log)
	if err != nil {
		return err
	}
	router.AddMiddleware(ib.Middleware) // innermost: after Retry and Recoverer, so each attempt gets its own transaction
	if err := f.Consume(router, infra.Brokers, log, "projection.orders", topics.OrderEvents, apply); err != nil {
		return err
	}
	if err := f.Consume(router, infra.Brokers, log, "projection.reminders", topics.Reminders, remind); err != nil {
		return err
	}

	mux := http.NewServeMux()
	mux.HandleFunc("GET /customers/{id}/orders", func(w http.ResponseWriter, r *http.Request) { customerOrders(w, r, pool) })
	platform.HandleOps(mux, func() map[string]int64 {
		s := counters.Snapshot()
		return map[string]int64{"processed": s.Processed, "inbox_duplicates": s.Duplicates, "failures": s.Failures}
	})
	// The projection writes no events, so it needs no relay.
	return platform.Run(ctx,
		router.Run,
		func(ctx context.Context) error {
			if err := platform.WaitRunning(ctx, router); err != nil {
				return nil
			}
			return platform.Serve(ctx, f.Addr, mux, log)
		})
}

// apply runs inside the inbox's transaction, which already holds the event's dedup row.
func apply(msg *message.Message) error {
	var ev checkout.OrderEvent
	if err := json.Unmarshal(msg.Payload, &ev); err != nil {
		// No retry can fix it: record it as seen and move on (a real service would park it
		// in a poison queue: Watermill's middleware.PoisonQueue).
		slog.Warn("projection: not an order event; dropped", "message_uuid", msg.UUID, "err", err)
		return nil
	}
	ctx := msg.Context()
	tx := outbox.MustTx(ctx)
	// Naturally idempotent: absolute state, and only forward (version guard).
	if _, err := tx.Exec(ctx, `
		INSERT INTO order_projection AS p (order_id, customer_id, sku, quantity, amount, status, reason, version)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
		ON CONFLICT (order_id) DO UPDATE SET status = excluded.status, reason = excluded.reason,
			version = excluded.version, updated_at = now()
		WHERE p.version < excluded.version`,
		ev.OrderID, ev.CustomerID, ev.SKU, ev.Quantity, ev.Amount, ev.Status, ev.Reason, ev.Version); err != nil {
		return err
	}
	if ev.Type != checkout.OrderCreated {
		return nil
	}
	// Not idempotent on its own: without the dedup row, a redelivery counts twice.
	_, err := tx.Exec(ctx, `INSERT INTO customer_orders AS c (customer_id, orders) VALUES ($1, 1)
		ON CONFLICT (customer_id) DO UPDATE SET orders = c.orders + 1`, ev.CustomerID)
	return err
}

// remind records an order's reminder (the orders service scheduled it with the order; the
// relay published it when due) as sent: where a real service would e-mail the customer, it
// counts. Like customer_orders it is a relative update, reminders = reminders + 1, so the
// inbox's dedup row, in this transaction, is what keeps a redelivered reminder from counting
// (or mailing) twice.
func remind(msg *message.Message) error {
	var r checkout.OrderReminder
	if err := json.Unmarshal(msg.Payload, &r); err != nil || r.OrderID == "" {
		slog.Warn("projection: not an order reminder; dropped", "message_uuid", msg.UUID, "err", err)
		return nil
	}
	ctx := msg.Context()
	_, err := outbox.MustTx(ctx).Exec(ctx, `INSERT INTO order_reminder AS r (order_id, customer_id, due_at, reminders)
		VALUES ($1, $2, $3, 1)
		ON CONFLICT (order_id) DO UPDATE SET reminders = r.reminders + 1`, r.OrderID, r.CustomerID, r.DueAt)
	return err
}

// customerOrders handles GET /customers/{id}/orders: how many orders the customer placed.
func customerOrders(w http.ResponseWriter, r *http.Request, pool *pgxpool.Pool) {
	var n int
	err := pool.QueryRow(r.Context(), `SELECT orders FROM customer_orders WHERE customer_id = $1`, r.PathValue("id")).Scan(&n)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		platform.Problem(w, http.StatusInternalServerError, "internal", "internal error", nil)
		return
	}
	platform.WriteJSON(w, http.StatusOK, map[string]any{"customer_id": r.PathValue("id"), "orders": n})
}
