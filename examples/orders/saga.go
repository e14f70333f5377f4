package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/examples/internal/checkout"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

// Checkout is the saga's data: what its commands and compensations are built from. Replies
// add to it (ReservationID, PaymentID); it is stored with the saga row.
type Checkout struct {
	OrderID       string `json:"order_id"`
	CustomerID    string `json:"customer_id"`
	SKU           string `json:"sku"`
	Quantity      int    `json:"quantity"`
	Amount        int64  `json:"amount"`
	ReservationID string `json:"reservation_id,omitempty"`
	PaymentID     string `json:"payment_id,omitempty"`
}

// checkoutVersion is the checkout definition new orders start on (see checkoutSaga).
const checkoutVersion = 2

// The charge step's retry budget. A re-send waits the longer of the participant's wait (the
// provider's, through inbox.RetryAfter) and the backoff, which doubles from chargeBackoff
// (saga.MaxBackoff at most): kept short so that the provider's wait sets the pace. Eight
// attempts span about half a minute of a provider that keeps answering "unavailable" before
// the saga compensates (stock released, order cancelled, "after 8 attempts" in its reason).
// Only re-sends read these: a saga already running takes them up at its next retry, so
// tuning them needs no new definition version.
const (
	chargeAttempts = 8
	chargeBackoff  = 250 * time.Millisecond
)

// checkoutSaga is place order → reserve stock → charge → confirm. The orders service's own
// steps, place-order and confirm, and place-order's compensation (cancel) are local: they run
// in this service's database, in the transaction of the orchestrator's transition that reaches
// them, so they happen exactly once with the saga's state change, with no command to itself,
// no reply and no barrier. A business failure (out of stock, payment declined) compensates
// the steps before it, last first: stock released, order cancelled. Confirm is the pivot:
// once stock and money are taken, the order is confirmed, retried until it is.
//
// Version 2. Version 1 (checkoutSagaV1) sent place, confirm and cancel as commands to this
// same service; it stays registered until no saga of it runs (see main.go).
func checkoutSaga(t checkout.Topics, s *service) *saga.Definition[Checkout] {
	return saga.MustDefine("checkout", checkoutVersion, []*saga.StepDef[Checkout]{
		// The order row was written with the saga's start, in the same transaction
		// (createOrder starts the saga with saga.RunLocalSteps, so this step runs there too).
		// The step exists for its compensation, which cancels the order when a later step
		// fails; its action has nothing left to do.
		saga.Step[Checkout]("place-order").
			Local(func(context.Context, pgx.Tx, *Checkout) error { return nil }).
			CompensateLocal(s.cancelLocal),
		saga.Step[Checkout]("reserve-stock").
			Send(t.Reserve, func(c Checkout) (any, error) {
				return checkout.ReserveStock{OrderID: c.OrderID, SKU: c.SKU, Quantity: c.Quantity}, nil
			}).
			OnReply(onReserved).
			Compensate(t.Release, func(c Checkout) (any, error) { return checkout.ReleaseStock{OrderID: c.OrderID}, nil }),
		// No Timeout on the charge: a timed-out charge would be compensated while the
		// provider may have charged in an attempt whose transaction never committed, and the
		// barrier would answer that refund as a null compensation (see examples/payments).
		// While the provider is unavailable, payments answers inbox.RetryAfter: a retry reply
		// with the provider's wait, and this step re-sends the charge no sooner, as its next
		// attempt. chargeAttempts gives an outage room before the order is given up.
		saga.Step[Checkout]("charge").
			Send(t.Charge, func(c Checkout) (any, error) {
				return checkout.Charge{OrderID: c.OrderID, CustomerID: c.CustomerID, Amount: c.Amount}, nil
			}).
			OnReply(onCharged).
			Compensate(t.Refund, func(c Checkout) (any, error) { return checkout.Refund{OrderID: c.OrderID}, nil }).
			Attempts(chargeAttempts, chargeBackoff),
		saga.Step[Checkout]("confirm").
			Local(func(ctx context.Context, tx pgx.Tx, c *Checkout) error {
				return s.finish(ctx, tx, c.OrderID, "confirmed", "", checkout.OrderConfirmed)
			}).
			Pivot(),
	}, saga.WithReplyTopic(t.Replies))
}

// checkoutSagaV1 is the checkout saga as version 1 defined it: the orders service's own steps
// were commands it sent to itself (orders.place, orders.confirm, orders.cancel) through its
// outbox, the relay and Kafka, and answered as a participant (place, confirm, cancel below).
// Every saga runs to its end on the version it started with, so this definition and those
// participant handlers stay until `onceflow saga list --name checkout` shows no version-1 saga
// running; then remove both (and the three topics).
func checkoutSagaV1(t checkout.Topics) *saga.Definition[Checkout] {
	orderRef := func(c Checkout) (any, error) { return checkout.OrderRef{OrderID: c.OrderID}, nil }
	return saga.MustDefine("checkout", 1, []*saga.StepDef[Checkout]{
		saga.Step[Checkout]("place-order").
			Send(t.PlaceOrder, orderRef).
			Compensate(t.CancelOrder, orderRef),
		saga.Step[Checkout]("reserve-stock").
			Send(t.Reserve, func(c Checkout) (any, error) {
				return checkout.ReserveStock{OrderID: c.OrderID, SKU: c.SKU, Quantity: c.Quantity}, nil
			}).
			OnReply(onReserved).
			Compensate(t.Release, func(c Checkout) (any, error) { return checkout.ReleaseStock{OrderID: c.OrderID}, nil }),
		saga.Step[Checkout]("charge").
			Send(t.Charge, func(c Checkout) (any, error) {
				return checkout.Charge{OrderID: c.OrderID, CustomerID: c.CustomerID, Amount: c.Amount}, nil
			}).
			OnReply(onCharged).
			Compensate(t.Refund, func(c Checkout) (any, error) { return checkout.Refund{OrderID: c.OrderID}, nil }),
		saga.Step[Checkout]("confirm").
			Send(t.ConfirmOrder, orderRef).
			Pivot(),
	}, saga.WithReplyTopic(t.Replies))
}

// onReserved and onCharged keep what inventory and payments answered, for the compensations.
func onReserved(c *Checkout, r saga.Reply) error {
	var res checkout.Reserved
	err := r.Decode(&res)
	c.ReservationID = res.ReservationID
	return err
}

func onCharged(c *Checkout, r saga.Reply) error {
	var res checkout.Charged
	err := r.Decode(&res)
	c.PaymentID = res.PaymentID
	return err
}

// cancelLocal is place-order's local compensation (version 2): it cancels the order with the
// saga's reason and withdraws its reminder (finish), in the orchestrator's transition. The
// saga row is written after it returns, so the reason comes from saga.LocalRunFrom, not from
// the row.
func (s *service) cancelLocal(ctx context.Context, tx pgx.Tx, c *Checkout) error {
	reason := "cancelled"
	if r, ok := saga.LocalRunFrom(ctx); ok && r.Error != "" {
		reason = r.Error
	}
	return s.finish(ctx, tx, c.OrderID, "cancelled", reason, checkout.OrderCancelled)
}

// The orders service's participant handlers, for sagas of version 1 only (checkoutSagaV1).
// Each runs in the command's transaction, with its dedup row, the barrier's rows and the
// reply: a redelivered command changes nothing.

// place is the no-op action of the place-order step.
func (s *service) place(context.Context, pgx.Tx, checkout.OrderRef) (struct{}, error) {
	return struct{}{}, nil
}

// confirm marks the order confirmed and publishes OrderConfirmed, in one transaction.
func (s *service) confirm(ctx context.Context, tx pgx.Tx, cmd checkout.OrderRef) (struct{}, error) {
	return struct{}{}, s.finish(ctx, tx, cmd.OrderID, "confirmed", "", checkout.OrderConfirmed)
}

// cancel is version 1's compensation of place-order: the order is cancelled with the saga's reason
// (the orchestrator's row is in this schema, so the reason is a query away).
func (s *service) cancel(ctx context.Context, tx pgx.Tx, cmd checkout.OrderRef) error {
	reason := "cancelled"
	if d, err := s.admin.Get(ctx, tx, cmd.OrderID); err == nil && d.Error != "" {
		reason = d.Error
	}
	return s.finish(ctx, tx, cmd.OrderID, "cancelled", reason, checkout.OrderCancelled)
}

// finish moves a pending order to status (confirmed or cancelled) and publishes eventType; a
// cancellation also withdraws the order's reminder. All of it in tx: the saga's transition
// (version 2) or the command's transaction (version 1).
func (s *service) finish(ctx context.Context, tx pgx.Tx, orderID, status, reason, eventType string) error {
	var ev checkout.OrderEvent
	var reminderID *string
	err := tx.QueryRow(ctx, `
		UPDATE orders SET status = $2, reason = $3, version = version + 1, updated_at = now()
		WHERE id = $1 AND status = 'pending'
		RETURNING id, customer_id, sku, quantity, amount, status, reason, version, reminder_id::text`,
		orderID, status, reason).
		Scan(&ev.OrderID, &ev.CustomerID, &ev.SKU, &ev.Quantity, &ev.Amount, &ev.Status, &ev.Reason, &ev.Version, &reminderID)
	if errors.Is(err, pgx.ErrNoRows) {
		// Not pending any more. In the saga's own transition (version 2's local steps) or
		// behind the barrier (version 1's commands) this does not happen; if it does, an order
		// already in the wanted state needs nothing, and anything else is a bug to look at
		// (the local step runs again after its backoff, or the command fails and is
		// redelivered; visible in the logs and in `onceflow saga show`).
		var current string
		if err := tx.QueryRow(ctx, `SELECT status FROM orders WHERE id = $1`, orderID).Scan(&current); err != nil {
			return fmt.Errorf("order %s: %w", orderID, err)
		}
		if current == status {
			return nil
		}
		return fmt.Errorf("order %s is %s, cannot make it %s", orderID, current, status)
	}
	if err != nil {
		return err
	}
	if status == "cancelled" && reminderID != nil {
		if err := s.withdrawReminder(ctx, tx, orderID, *reminderID); err != nil {
			return err
		}
	}
	ev.Type = eventType
	return s.publish(ctx, tx, ev)
}

// reminder makes msg the order's reminder r, for the reminders topic, due s.remindAfter after
// the transaction that writes it began: the relay publishes it then, unless withdrawReminder
// withdrew it.
func (s *service) reminder(msg *message.Message, r checkout.OrderReminder) error {
	payload, err := json.Marshal(r)
	if err != nil {
		return err
	}
	msg.Payload = payload
	msg.Metadata.Set("type", "OrderReminder")
	outbox.DeliverAfter(outbox.ToTopic(msg, s.topics.Reminders), s.remindAfter)
	return nil
}

// withdrawReminder cancels a cancelled order's reminder, in the cancellation's transaction:
// if that commits, the reminder is never published. Writer.CancelTx (outbox.CancelTx for the
// default schema) reports false when the reminder is no longer waiting: it was due and
// already moved to the outbox to be published, and nothing recalls it — too late, which the
// order row records (its consumer sees the order cancelled by then, or soon after), with the
// time it was found gone (clock_timestamp(), not the transaction's start: after the move).
func (s *service) withdrawReminder(ctx context.Context, tx pgx.Tx, orderID, reminderID string) error {
	withdrawn, err := s.writer.CancelTx(ctx, tx, reminderID)
	if err != nil {
		return err
	}
	outcome := "withdrawn"
	if !withdrawn {
		outcome = "too late"
		slog.Info("orders: the cancelled order's reminder was already on its way", "order_id", orderID, "event_id", reminderID)
	}
	_, err = tx.Exec(ctx, `UPDATE orders SET reminder = $2, reminder_cancel = clock_timestamp() WHERE id = $1`, orderID, outcome)
	return err
}

// publish writes an order event into the outbox, in tx.
func (s *service) publish(ctx context.Context, tx pgx.Tx, ev checkout.OrderEvent) error {
	msg, err := orderEvent(ev)
	if err != nil {
		return err
	}
	return s.writer.WriteTx(ctx, tx, s.topics.OrderEvents, msg)
}

// orderEvent returns ev as a message keyed by the order, so that one order's events keep
// their order.
func orderEvent(ev checkout.OrderEvent) (*message.Message, error) {
	payload, err := json.Marshal(ev)
	if err != nil {
		return nil, err
	}
	msg := outbox.SetPartitionKey(outbox.NewMessage(payload), ev.OrderID)
	msg.Metadata.Set("type", ev.Type)
	return msg, nil
}
