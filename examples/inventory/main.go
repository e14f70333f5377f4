// Command inventory is the example shop's stock service, a participant of the checkout saga:
// it reserves stock for an order (a business failure when stock is short, which makes the saga
// compensate) and releases the reservation when a later step fails (the compensation).
//
// Both handlers are plain functions on the command's transaction; saga.Action and
// saga.Compensation make them idempotent: the command's dedup row, the barrier's rows, the
// stock update and the reply commit together, so a duplicated, late or reordered command acts
// at most once, and a release whose reservation never happened does nothing.
//
//	go run ./examples/inventory -addr 127.0.0.1:8081
//
// With DATABASE_URL and KAFKA_BROKERS unset it starts an embedded PostgreSQL and Kafka and
// says so. See README.md.
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/examples/internal/checkout"
	"github.com/onceflow/onceflow/examples/internal/platform"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

const ddl = `
CREATE TABLE IF NOT EXISTS stock (
	sku       text PRIMARY KEY,
	available int NOT NULL CHECK (available >= 0)
);
CREATE TABLE IF NOT EXISTS reservation (
	id          uuid PRIMARY KEY,
	order_id    text NOT NULL UNIQUE, -- one reservation per order
	sku         text NOT NULL,
	quantity    int NOT NULL,
	status      text NOT NULL DEFAULT 'reserved', -- reserved, released
	created_at  timestamptz NOT NULL DEFAULT now(),
	released_at timestamptz
)`

func main() {
	f := platform.RegisterFlags("127.0.0.1:8081", "inventory")
	platform.Main("inventory", f, func(ctx context.Context, log *slog.Logger) error { return run(ctx, f, log) })
}

func run(ctx context.Context, f *platform.Flags, log *slog.Logger) error {
	infra, err := platform.StartInfra(ctx, log)
	if err != nil {
		return err
	}
	defer infra.Close()
	pool, err := platform.OpenSchema(ctx, infra.DatabaseURL, f.Schema, ddl, 12)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := seedStock(ctx, pool); err != nil {
		return err
	}
	topics := checkout.NewTopics(f.TopicPrefix)
	if err := platform.CreateTopics(ctx, infra.Brokers, topics.All()...); err != nil {
		return err
	}

	counters := &saga.Counters{}
	inv, err := saga.NewParticipant(saga.ParticipantConfig{Pool: pool, Schema: f.Schema, Consumer: "inventory",
		Logger: log, Metrics: counters})
	if err != nil {
		return err
	}
	router, err := platform.NewRouter(log)
	if err != nil {
		return err
	}
	// Participants run without the inbox middleware: they deduplicate themselves.
	if err := f.Consume(router, infra.Brokers, log, "inventory.reserve", topics.Reserve, saga.Action(inv, reserve)); err != nil {
		return err
	}
	if err := f.Consume(router, infra.Brokers, log, "inventory.release", topics.Release, saga.Compensation(inv, release)); err != nil {
		return err
	}

	mux := http.NewServeMux()
	platform.HandleOps(mux, func() map[string]int64 {
		s := counters.Snapshot()
		return map[string]int64{"barrier_duplicates": s.Duplicates, "null_compensations": s.NullCompensations, "hanging_actions": s.HangingActions}
	})
	parts := []func(context.Context) error{
		router.Run,
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

// reserve takes the order's quantity out of stock and records the reservation. Short stock
// is a business failure (saga.Fail): nothing is written, and the saga compensates the steps
// before this one. Any other error fails the message, which is redelivered.
func reserve(ctx context.Context, tx pgx.Tx, cmd checkout.ReserveStock) (checkout.Reserved, error) {
	tag, err := tx.Exec(ctx, `UPDATE stock SET available = available - $2 WHERE sku = $1 AND available >= $2`,
		cmd.SKU, cmd.Quantity)
	if err != nil {
		return checkout.Reserved{}, err
	}
	if tag.RowsAffected() == 0 {
		return checkout.Reserved{}, saga.Fail(fmt.Sprintf("out of stock: %d × %s", cmd.Quantity, cmd.SKU))
	}
	id := outbox.NewUUID()
	if _, err := tx.Exec(ctx, `INSERT INTO reservation (id, order_id, sku, quantity) VALUES ($1, $2, $3, $4)`,
		id, cmd.OrderID, cmd.SKU, cmd.Quantity); err != nil {
		return checkout.Reserved{}, err
	}
	return checkout.Reserved{ReservationID: id}, nil
}

// release puts a reserved quantity back. The barrier calls it only if the reservation's
// action took effect; the status check keeps it correct even when called twice by hand.
func release(ctx context.Context, tx pgx.Tx, cmd checkout.ReleaseStock) error {
	var sku string
	var qty int
	err := tx.QueryRow(ctx, `UPDATE reservation SET status = 'released', released_at = now()
		WHERE order_id = $1 AND status = 'reserved' RETURNING sku, quantity`, cmd.OrderID).Scan(&sku, &qty)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil // nothing reserved: nothing to give back
	}
	if err != nil {
		return err
	}
	_, err = tx.Exec(ctx, `UPDATE stock SET available = available + $2 WHERE sku = $1`, sku, qty)
	return err
}

// seedStock fills an empty stock table from the catalogue.
func seedStock(ctx context.Context, pool *pgxpool.Pool) error {
	for _, p := range checkout.Catalogue {
		if _, err := pool.Exec(ctx, `INSERT INTO stock (sku, available) VALUES ($1, $2) ON CONFLICT DO NOTHING`, p.SKU, p.Stock); err != nil {
			return err
		}
	}
	return nil
}
