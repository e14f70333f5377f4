// Package checkout is the wire contract of the example services: the topics, the saga's
// commands and replies, the order events and the product catalogue. Services that talk over
// Kafka share such a contract (a Go package, protobuf, JSON Schema); each service keeps its
// own tables and logic.
package checkout

import "time"

// Topics names the Kafka topics of the checkout flow.
type Topics struct {
	// Saga commands, sent by the orchestrator (orders) through its outbox.
	// To orders itself, by checkout version 1 only: version 2 runs these steps locally.
	// Remove them with version 1 (examples/orders, checkoutSagaV1).
	PlaceOrder, CancelOrder, ConfirmOrder string
	Reserve, Release                      string // to inventory
	Charge, Refund                        string // to payments
	// Replies is where every participant answers; the orchestrator consumes it.
	Replies string
	// OrderEvents carries OrderCreated, OrderConfirmed and OrderCancelled, for read models.
	OrderEvents string
	// Reminders carries OrderReminder: scheduled by orders with each order, published when
	// due, withdrawn if the order is cancelled first; the projection consumes it.
	Reminders string
}

// NewTopics returns the topic names, each with prefix in front (empty for the plain names).
func NewTopics(prefix string) Topics {
	return Topics{
		PlaceOrder:   prefix + "orders.place",
		CancelOrder:  prefix + "orders.cancel",
		ConfirmOrder: prefix + "orders.confirm",
		Reserve:      prefix + "inventory.reserve",
		Release:      prefix + "inventory.release",
		Charge:       prefix + "payments.charge",
		Refund:       prefix + "payments.refund",
		Replies:      prefix + "checkout.replies",
		OrderEvents:  prefix + "orders.events",
		Reminders:    prefix + "orders.reminders",
	}
}

// All returns every topic, for provisioning.
func (t Topics) All() []string {
	return []string{t.PlaceOrder, t.CancelOrder, t.ConfirmOrder, t.Reserve, t.Release, t.Charge, t.Refund, t.Replies, t.OrderEvents, t.Reminders}
}

// OrderRef is checkout version 1's command to the orders participant: place (a no-op that
// gives the saga a step to compensate), confirm or cancel an order.
type OrderRef struct {
	OrderID string `json:"order_id"`
}

// ReserveStock asks inventory to set Quantity of SKU aside for an order.
type ReserveStock struct {
	OrderID  string `json:"order_id"`
	SKU      string `json:"sku"`
	Quantity int    `json:"quantity"`
}

// Reserved is inventory's reply to ReserveStock.
type Reserved struct {
	ReservationID string `json:"reservation_id"`
}

// ReleaseStock undoes ReserveStock.
type ReleaseStock struct {
	OrderID string `json:"order_id"`
}

// Charge asks payments to take Amount (in cents) from the customer for an order.
type Charge struct {
	OrderID    string `json:"order_id"`
	CustomerID string `json:"customer_id"`
	Amount     int64  `json:"amount"`
}

// Charged is payments' reply to Charge.
type Charged struct {
	PaymentID         string `json:"payment_id"`
	ExternalPaymentID string `json:"external_payment_id"`
}

// Refund undoes Charge.
type Refund struct {
	OrderID string `json:"order_id"`
}

// Order event types, in OrderEvent.Type.
const (
	OrderCreated   = "OrderCreated"
	OrderConfirmed = "OrderConfirmed"
	OrderCancelled = "OrderCancelled"
)

// OrderEvent is a domain event of the orders service. It carries the order's whole state
// (absolute, not a delta) and its version, so a read model can apply it with a
// version-guarded upsert.
type OrderEvent struct {
	Type       string `json:"type"`
	OrderID    string `json:"order_id"`
	CustomerID string `json:"customer_id"`
	SKU        string `json:"sku"`
	Quantity   int    `json:"quantity"`
	Amount     int64  `json:"amount"`
	Status     string `json:"status"`
	Reason     string `json:"reason,omitempty"`
	Version    int    `json:"version"`
}

// OrderReminder is the follow-up the orders service schedules with every order, in the
// order's own transaction (outbox.DeliverAfter): "how was your order?", due some time after it
// was placed (a day in a real shop, seconds in the demo). Cancelling the order withdraws it
// (outbox.CancelTx) unless it was already on its way.
type OrderReminder struct {
	OrderID    string    `json:"order_id"`
	CustomerID string    `json:"customer_id"`
	DueAt      time.Time `json:"due_at"` // when it is due: the order's transaction time plus the delay
}

// Product is an entry of the catalogue.
type Product struct {
	SKU   string
	Price int64 // cents
	Stock int   // units in stock when inventory starts with an empty table
}

// Catalogue is what the shop sells. "poster" is scarce on purpose: orders for it run out of
// stock, and the saga compensates.
var Catalogue = []Product{
	{SKU: "book", Price: 1800, Stock: 1000},
	{SKU: "mug", Price: 900, Stock: 1000},
	{SKU: "lamp", Price: 4500, Stock: 1000},
	{SKU: "poster", Price: 1200, Stock: 12},
}

// Price returns the price of sku, and false for a SKU that is not sold.
func Price(sku string) (int64, bool) {
	for _, p := range Catalogue {
		if p.SKU == sku {
			return p.Price, true
		}
	}
	return 0, false
}
