package main

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/examples/internal/checkout"
	"github.com/onceflow/onceflow/examples/internal/platform"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

// order is the API's view of an order.
type order struct {
	ID       string `json:"id"`
	SKU      string `json:"sku"`
	Quantity int    `json:"quantity"`
	Amount   int64  `json:"amount"`
	Status   string `json:"status"`
	Reason   string `json:"reason,omitempty"`
}

// createOrder handles POST /orders behind the idempotency middleware (mw.Require): it runs
// once per (customer, Idempotency-Key), in the transaction the middleware opened. The order
// row, the OrderCreated event, the order's scheduled reminder, the saga's start and the stored
// response commit together; a retry gets this response back without running the handler.
func (s *service) createOrder(w http.ResponseWriter, r *http.Request) {
	var req struct {
		SKU      string `json:"sku"`
		Quantity int    `json:"quantity"`
	}
	dec := json.NewDecoder(r.Body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil || dec.More() {
		platform.Problem(w, http.StatusBadRequest, "malformed-json", "the body must be one JSON object {\"sku\": string, \"quantity\": int}", nil)
		return
	}
	invalid := map[string]string{}
	price, known := checkout.Price(req.SKU)
	if !known {
		invalid["sku"] = "unknown product"
	}
	if req.Quantity <= 0 {
		invalid["quantity"] = "must be greater than 0"
	}
	if len(invalid) > 0 {
		// 4xx responses are stored too: the same key gets the same answer.
		platform.Problem(w, http.StatusUnprocessableEntity, "invalid-order", "some fields are invalid", map[string]any{"invalid": invalid})
		return
	}

	ctx := r.Context()
	tx := outbox.MustTx(ctx) // the middleware's transaction; it commits after we return
	customer, _ := customerID(r)
	key, _ := idempotency.ParseKey(r.Header.Get(idempotency.HeaderKey)) // the middleware checked it
	o := order{ID: outbox.NewUUID(), SKU: req.SKU, Quantity: req.Quantity, Amount: price * int64(req.Quantity), Status: "pending"}
	reminder := outbox.SetPartitionKey(outbox.NewMessage(nil), o.ID) // its event id goes on the order row
	var placedAt time.Time                                           // now(): the transaction's start
	if err := tx.QueryRow(ctx, `INSERT INTO orders (id, customer_id, idempotency_key, sku, quantity, amount, reminder_id, reminder)
		VALUES ($1, $2, $3, $4, $5, $6, $7, 'scheduled') RETURNING created_at`, o.ID, customer, key, o.SKU, o.Quantity, o.Amount, reminder.UUID).
		Scan(&placedAt); err != nil {
		serverError(w, err)
		return
	}
	created, err := orderEvent(checkout.OrderEvent{Type: checkout.OrderCreated, OrderID: o.ID, CustomerID: customer,
		SKU: o.SKU, Quantity: o.Quantity, Amount: o.Amount, Status: o.Status, Version: 1})
	if err == nil {
		err = s.reminder(reminder, checkout.OrderReminder{OrderID: o.ID, CustomerID: customer, DueAt: placedAt.Add(s.remindAfter)})
	}
	// OrderCreated and the reminder in one statement (the reminder names its own topic). The
	// reminder is written now, with the order, and published when due: DeliverAfter counts from
	// this transaction's start on the database's clock (now(), the order's created_at), so the
	// due time in its payload is exactly the one the relay waits for. It waits in the
	// outbox_scheduled table, not in the outbox; cancelling the order withdraws it (finish).
	if err == nil {
		err = s.writer.WriteTx(ctx, tx, s.topics.OrderEvents, created, reminder)
	}
	if err != nil {
		serverError(w, err)
		return
	}
	// The saga's row, its local first step (place-order) and its first command (reserve
	// stock, in the outbox) join the same transaction: saga.RunLocalSteps runs the local step
	// here rather than in a transition of its own after the commit, so the order is placed
	// with the saga's start, or not at all. The order id is the saga id, so the saga is found
	// from the order and vice versa.
	_, err = saga.StartTx(ctx, tx, s.checkout,
		Checkout{OrderID: o.ID, CustomerID: customer, SKU: o.SKU, Quantity: o.Quantity, Amount: o.Amount},
		saga.WithID(o.ID), saga.WithWriter(s.writer), saga.WithMetrics(s.orch.Metrics()), saga.RunLocalSteps())
	if err != nil {
		serverError(w, err)
		return
	}
	w.Header().Set("Location", "/orders/"+o.ID)
	platform.WriteJSON(w, http.StatusCreated, o)
}

// getOrder handles GET /orders/{id}: the order with its status, to its owner only. Anyone
// else gets 404, as for an order that does not exist, so ids cannot be probed.
func (s *service) getOrder(w http.ResponseWriter, r *http.Request) {
	customer, err := customerID(r)
	if err != nil {
		platform.Problem(w, http.StatusUnauthorized, "no-customer", "send X-Customer-ID", nil)
		return
	}
	var o order
	err = s.pool.QueryRow(r.Context(), `SELECT id, sku, quantity, amount, status, reason FROM orders
		WHERE id::text = $1 AND customer_id = $2`, r.PathValue("id"), customer).
		Scan(&o.ID, &o.SKU, &o.Quantity, &o.Amount, &o.Status, &o.Reason)
	if errors.Is(err, pgx.ErrNoRows) {
		platform.Problem(w, http.StatusNotFound, "no-such-order", "no order with this id", nil)
		return
	}
	if err != nil {
		serverError(w, err)
		return
	}
	platform.WriteJSON(w, http.StatusOK, o)
}

// serverError answers 500: the middleware rolls the transaction back and stores nothing, so a
// retry with the same key runs the handler again.
func serverError(w http.ResponseWriter, err error) {
	if errors.Is(err, context.Canceled) {
		slog.Info("orders: the client went away; nothing stored", "err", err)
	} else {
		slog.Error("orders: request failed", "err", err)
	}
	platform.Problem(w, http.StatusInternalServerError, "internal", "internal error; retrying with the same Idempotency-Key is safe", nil)
}
