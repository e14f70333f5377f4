package main

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/outbox"
)

// providerName is what payment.payment_provider records for this provider.
const providerName = "fakecard"

// provider is a fake card processor. Like a real one (Stripe, Adyen), it takes an idempotency
// key with every request and answers a repeated key with the first answer, so a charge sent
// again after a crash or a lost response is not taken twice; and it declines a customer over
// their limit. Its state is its own table, written in its own transactions, never in the
// caller's: calling it is an effect outside our transaction, as calling a real provider is.
type provider struct {
	pool  *pgxpool.Pool
	limit int64 // cents a customer may have charged (net of refunds)
}

// providerDDL is the provider's memory; a real provider keeps this on its side.
// fake_provider_outage holds its outages: while a row's window covers the time, every request
// is answered "unavailable" (a real provider's 503), and counted there. Make one with
//
//	INSERT INTO payments.fake_provider_outage (down_until) VALUES (now() + interval '30 seconds')
const providerDDL = `
CREATE TABLE IF NOT EXISTS fake_provider_charge (
	idempotency_key text PRIMARY KEY,
	external_id     text NOT NULL UNIQUE,
	customer_id     text NOT NULL,
	amount          bigint NOT NULL,
	declined        boolean NOT NULL,
	refunded        boolean NOT NULL DEFAULT false,
	requests        int NOT NULL DEFAULT 1 -- how often the key was sent: >1 means the key saved a double charge
);
CREATE TABLE IF NOT EXISTS fake_provider_outage (
	down_from  timestamptz NOT NULL DEFAULT now(),
	down_until timestamptz NOT NULL,
	refused    int NOT NULL DEFAULT 0 -- requests answered "unavailable" during it
)`

// errUnavailable is the provider's answer while it is down (a real one's 503 Service
// Unavailable): nothing was charged, and the same request may be sent again later.
var errUnavailable = errors.New("the payment provider is unavailable (503)")

// providerResult is the provider's answer to a charge.
type providerResult struct {
	ExternalID string
	Declined   bool
}

// Charge charges customer amount cents under key, or returns the answer the key got before.
// While the provider is down it returns errUnavailable and charges nothing.
func (p *provider) Charge(ctx context.Context, key, customer string, amount int64) (providerResult, error) {
	var res providerResult
	down := false
	err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		// Down: refuse before looking at anything (and count the refusal, so the transaction
		// commits and errUnavailable is returned after it).
		tag, err := tx.Exec(ctx, `UPDATE fake_provider_outage SET refused = refused + 1
			WHERE clock_timestamp() >= down_from AND clock_timestamp() < down_until`)
		if down = tag.RowsAffected() > 0; err != nil || down {
			return err
		}
		// One customer's charges one at a time, as their card balance would be.
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('fake-provider:' || $1))`, customer); err != nil {
			return err
		}
		err = tx.QueryRow(ctx, `UPDATE fake_provider_charge SET requests = requests + 1
			WHERE idempotency_key = $1 RETURNING external_id, declined`, key).Scan(&res.ExternalID, &res.Declined)
		if !errors.Is(err, pgx.ErrNoRows) {
			return err // nil: the key was seen before, and this is its first answer
		}
		var spent int64
		if err := tx.QueryRow(ctx, `SELECT coalesce(sum(amount), 0) FROM fake_provider_charge
			WHERE customer_id = $1 AND NOT declined AND NOT refunded`, customer).Scan(&spent); err != nil {
			return err
		}
		res = providerResult{ExternalID: "ch_" + outbox.NewUUID(), Declined: spent+amount > p.limit}
		_, err = tx.Exec(ctx, `INSERT INTO fake_provider_charge (idempotency_key, external_id, customer_id, amount, declined)
			VALUES ($1, $2, $3, $4, $5)`, key, res.ExternalID, customer, amount, res.Declined)
		return err
	})
	if err == nil && down {
		return providerResult{}, errUnavailable
	}
	return res, err
}

// Refund refunds the charge made under key; refunding it again changes nothing.
func (p *provider) Refund(ctx context.Context, key string) error {
	_, err := p.pool.Exec(ctx, `UPDATE fake_provider_charge SET refunded = true WHERE idempotency_key = $1 AND NOT declined`, key)
	return err
}
