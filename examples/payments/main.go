// Command payments is the example shop's payment service: a participant of the checkout saga
// (charge, with refund as its compensation) and an HTTP API for direct charges
// (POST /payments with an Idempotency-Key). It shows money's double protection:
//
//  1. the charge goes to the provider with a stable idempotency key derived from the saga and
//     step ("saga:<order id>:charge"; the saga id is the order id), so a charge sent again —
//     after a crash between the provider's answer and our commit, or a redelivery that slipped
//     past the saga barrier — is answered with the first charge, not taken twice;
//  2. the payment row has UNIQUE (payment_provider, external_payment_id), so recording that
//     same charge twice is impossible: the duplicate is caught by the constraint and answered
//     with the existing payment (inbox.InsertOnce).
//
// A customer over their limit is declined: a business failure (saga.Fail), so the saga
// compensates (stock released, order cancelled). Nothing was charged, so nothing is refunded.
//
// While the provider is down (an outage in its table, fake_provider_outage) it answers
// "unavailable", and the charge asks to be tried again later: inbox.RetryAfter(err, d). The
// saga participant answers that at once as a retry carrying the wait, so this service's
// partition goes on with other orders' charges, and the orchestrator re-sends the charge no
// sooner, as the step's next attempt.
//
//	go run ./examples/payments -addr 127.0.0.1:8082
//
// With DATABASE_URL and KAFKA_BROKERS unset it starts an embedded PostgreSQL and Kafka and
// says so. See README.md.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/examples/internal/checkout"
	"github.com/onceflow/onceflow/examples/internal/platform"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

const ddl = `
CREATE TABLE IF NOT EXISTS payment (
	id                  uuid PRIMARY KEY,
	order_id            text,          -- the saga's order; NULL for a direct charge
	customer_id         text NOT NULL,
	amount              bigint NOT NULL,
	payment_provider    text NOT NULL,
	external_payment_id text NOT NULL, -- the provider's id of the charge
	status              text NOT NULL DEFAULT 'charged', -- charged, refunded
	created_at          timestamptz NOT NULL DEFAULT now(),
	-- The second barrier: one row per charge at the provider, whatever got past the first.
	CONSTRAINT payment_provider_external_id_key UNIQUE (payment_provider, external_payment_id)
);
CREATE INDEX IF NOT EXISTS payment_order_id ON payment (order_id);
` + providerDDL

func main() {
	f := platform.RegisterFlags("127.0.0.1:8082", "payments")
	limit := flag.Int64("limit", 100_000, "what the fake provider lets one customer spend, in cents, before it declines")
	retryAfter := flag.Duration("retry-after", time.Second, "how long a charge the provider refused as unavailable waits before it is sent again")
	platform.Main("payments", f, func(ctx context.Context, log *slog.Logger) error { return run(ctx, f, *limit, *retryAfter, log) })
}

type service struct {
	pool     *pgxpool.Pool
	provider *provider
	counters *platform.Counter
	// retryAfter is the wait a charge asks for while the provider is unavailable.
	retryAfter time.Duration
}

func run(ctx context.Context, f *platform.Flags, limit int64, retryAfter time.Duration, log *slog.Logger) error {
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
	s := &service{pool: pool, provider: &provider{pool: pool, limit: limit}, counters: &platform.Counter{}, retryAfter: retryAfter}

	sagaCounters := &saga.Counters{}
	part, err := saga.NewParticipant(saga.ParticipantConfig{Pool: pool, Schema: f.Schema, Consumer: "payments",
		Logger: log, Metrics: sagaCounters})
	if err != nil {
		return err
	}
	router, err := platform.NewRouter(log)
	if err != nil {
		return err
	}
	if err := f.Consume(router, infra.Brokers, log, "payments.charge", topics.Charge, saga.Action(part, s.charge)); err != nil {
		return err
	}
	if err := f.Consume(router, infra.Brokers, log, "payments.refund", topics.Refund, saga.Compensation(part, s.refund)); err != nil {
		return err
	}

	mw, err := idempotency.New(idempotency.Config{Pool: pool, Schema: f.Schema, Owner: customerID,
		Metrics: platform.HTTPMetrics{C: s.counters}})
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Require(http.HandlerFunc(s.createPayment)))
	platform.HandleOps(mux, func() map[string]int64 {
		c := s.counters.Snapshot()
		snap := sagaCounters.Snapshot()
		c["barrier_duplicates"], c["null_compensations"], c["hanging_actions"] = snap.Duplicates, snap.NullCompensations, snap.HangingActions
		return c
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

// chargeKey is the provider idempotency key of a saga's charge: the saga (whose id is the
// order id) and the step. Every attempt and every redelivery of the step sends the same key.
func chargeKey(orderID string) string { return "saga:" + orderID + ":charge" }

// charge is the saga's charge step. While the provider is unavailable nothing was charged, and
// retrying at once would only hold up this partition's other charges: inbox.RetryAfter answers
// the saga "retry, not before s.retryAfter", and the orchestrator's timer holds the wait (the
// step's next attempt sends the same provider key). Any other error from the provider fails
// the message, which is redelivered and sends the same key again: with money, an unknown
// outcome is retried, never given up on, so the provider's answer decides.
func (s *service) charge(ctx context.Context, tx pgx.Tx, cmd checkout.Charge) (checkout.Charged, error) {
	res, err := s.provider.Charge(ctx, chargeKey(cmd.OrderID), cmd.CustomerID, cmd.Amount)
	if errors.Is(err, errUnavailable) {
		s.counters.Add("provider_unavailable", 1)
		return checkout.Charged{}, inbox.RetryAfter(fmt.Errorf("provider: %w", err), s.retryAfter)
	}
	if err != nil {
		return checkout.Charged{}, fmt.Errorf("provider: %w", err)
	}
	if res.Declined {
		return checkout.Charged{}, saga.Fail("payment declined: over the customer's limit")
	}
	id, err := s.record(ctx, tx, &cmd.OrderID, cmd.CustomerID, cmd.Amount, res.ExternalID)
	return checkout.Charged{PaymentID: id, ExternalPaymentID: res.ExternalID}, err
}

// record inserts the payment, or finds it when the constraint says it is already there.
func (s *service) record(ctx context.Context, tx pgx.Tx, orderID *string, customer string, amount int64, externalID string) (string, error) {
	id := outbox.NewUUID()
	inserted, err := inbox.InsertOnce(ctx, tx, "payment_provider_external_id_key", func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO payment (id, order_id, customer_id, amount, payment_provider, external_payment_id)
			VALUES ($1, $2, $3, $4, $5, $6)`, id, orderID, customer, amount, providerName, externalID)
		return err
	})
	if err != nil || inserted {
		return id, err
	}
	s.counters.Add("unique_constraint_hits", 1) // the second barrier caught a duplicate
	err = tx.QueryRow(ctx, `SELECT id FROM payment WHERE payment_provider = $1 AND external_payment_id = $2`,
		providerName, externalID).Scan(&id)
	return id, err
}

// refund is the compensation of charge: it runs only if the charge took effect here (the
// barrier), refunds at the provider (idempotent there too) and marks the payment refunded.
func (s *service) refund(ctx context.Context, tx pgx.Tx, cmd checkout.Refund) error {
	var paymentID string
	err := tx.QueryRow(ctx, `UPDATE payment SET status = 'refunded' WHERE order_id = $1 AND status = 'charged' RETURNING id`,
		cmd.OrderID).Scan(&paymentID)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil // nothing charged: nothing to refund
	}
	if err != nil {
		return err
	}
	return s.provider.Refund(ctx, chargeKey(cmd.OrderID))
}

// createPayment handles POST /payments {"amount": cents}: a direct charge, once per
// (customer, Idempotency-Key). The provider key is derived from that pair, so even a retry
// that reaches us after the idempotency record expired charges nothing twice.
func (s *service) createPayment(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Amount int64 `json:"amount"`
	}
	dec := json.NewDecoder(r.Body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		platform.Problem(w, http.StatusBadRequest, "malformed-json", `the body must be {"amount": cents}`, nil)
		return
	}
	if req.Amount <= 0 {
		platform.Problem(w, http.StatusUnprocessableEntity, "invalid-payment", "amount must be greater than 0", nil)
		return
	}
	ctx := r.Context()
	customer, _ := customerID(r)
	key, _ := idempotency.ParseKey(r.Header.Get(idempotency.HeaderKey))
	res, err := s.provider.Charge(ctx, "http:"+customer+":"+key, customer, req.Amount)
	if errors.Is(err, errUnavailable) {
		// 5xx: not stored, so the client's retry with the same key charges then.
		w.Header().Set("Retry-After", fmt.Sprint(int(max(time.Second, s.retryAfter).Round(time.Second).Seconds())))
		platform.Problem(w, http.StatusServiceUnavailable, "provider-unavailable", "the payment provider is unavailable; retry later with the same Idempotency-Key", nil)
		return
	}
	if err != nil {
		serverError(w, err)
		return
	}
	if res.Declined {
		platform.Problem(w, http.StatusPaymentRequired, "declined", "payment declined: over the customer's limit", nil)
		return
	}
	id, err := s.record(ctx, outbox.MustTx(ctx), nil, customer, req.Amount, res.ExternalID)
	if err != nil {
		serverError(w, err)
		return
	}
	w.Header().Set("Location", "/payments/"+id)
	platform.WriteJSON(w, http.StatusCreated, map[string]any{"id": id, "amount": req.Amount, "status": "charged",
		"external_payment_id": res.ExternalID})
}

func customerID(r *http.Request) (string, error) {
	if id := r.Header.Get("X-Customer-ID"); id != "" {
		return id, nil
	}
	return "", idempotency.ErrNoOwner
}

func serverError(w http.ResponseWriter, err error) {
	if errors.Is(err, context.Canceled) {
		slog.Info("payments: the client went away; nothing stored", "err", err)
	} else {
		slog.Error("payments: request failed", "err", err)
	}
	platform.Problem(w, http.StatusInternalServerError, "internal", "internal error; retrying with the same Idempotency-Key is safe", nil)
}
