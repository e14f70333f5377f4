package docscheck_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
	"github.com/onceflow/onceflow/saga"
)

// This file holds code that README.md quotes verbatim (TestQuotedBlocks): the quickstart,
// which TestQuickstart runs, and a test of a handler written with onceflowtest.

// Order is the checkout saga's data.
type Order struct {
	ID  string `json:"id"`
	SKU string `json:"sku"`
}

// checkout is a one-step saga: reserve the stock (released again if a later step failed).
var checkout = saga.MustDefine("checkout", 1, []*saga.StepDef[Order]{
	saga.Step[Order]("reserve-stock").
		Send("inventory.reserve", func(o Order) (any, error) { return o, nil }).
		Compensate("inventory.release", func(o Order) (any, error) { return o, nil }),
})

// quickstart:begin

// placeOrder is the business transaction: the order row, its OrderPlaced event and the
// checkout saga's first command commit together, or none of them does.
func placeOrder(ctx context.Context, pool *pgxpool.Pool, o Order) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO orders (id, sku) VALUES ($1, $2)`, o.ID, o.SKU); err != nil {
			return err
		}
		evt := outbox.SetPartitionKey(outbox.NewMessage([]byte(`{"id":"`+o.ID+`"}`)), o.ID)
		if err := outbox.WriteTx(ctx, tx, "orders.placed", evt); err != nil {
			return err
		}
		_, err := saga.StartTx(ctx, tx, checkout, o, saga.WithID(o.ID)) // checkout: a saga.Definition
		return err
	})
}

// runRelay publishes the outbox to Kafka until ctx ends; or run `onceflow relay`.
func runRelay(ctx context.Context, pool *pgxpool.Pool, brokers []string) error {
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: brokers})
	if err != nil {
		return err
	}
	defer sink.Close()
	r, err := relay.New(relay.Config{Pool: pool, Sink: sink})
	if err != nil {
		return err
	}
	return r.Run(ctx)
}

// addBilling consumes orders.placed once per event: the invoice commits with its dedup row.
func addBilling(router *message.Router, pool *pgxpool.Pool, sub message.Subscriber) error {
	ib, err := inbox.New(inbox.Config{Pool: pool, Consumer: "billing"})
	if err != nil {
		return err
	}
	router.AddConsumerHandler("billing", "orders.placed", sub, func(msg *message.Message) error {
		tx := outbox.MustTx(msg.Context()) // the inbox's transaction
		_, err := tx.Exec(msg.Context(), `INSERT INTO invoice (event_id) VALUES ($1)`, msg.UUID)
		return err
	}).AddMiddleware(ib.Middleware)
	return nil
}

// quickstart:end

// The quickstart runs: an order placed once reaches billing once through the relay and
// Kafka, and its saga's first command is published too.
func TestQuickstart(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	db := onceflowtest.NewDB(t)
	kafka := onceflowtest.NewKafka(t, onceflowtest.KafkaOptions{
		Topics: []string{"orders.placed", "inventory.reserve", "inventory.release", "checkout.replies"},
	})
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE orders (id text PRIMARY KEY, sku text NOT NULL);
		CREATE TABLE invoice (event_id uuid PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	relayDone := make(chan error, 1)
	go func() { relayDone <- runRelay(runCtx, db.Pool, kafka.Brokers) }()

	logger := watermill.NopLogger{}
	sub, err := inboxkafka.NewSubscriber(kafka.Brokers, "billing", logger)
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		t.Fatal(err)
	}
	if err := addBilling(router, db.Pool, sub); err != nil {
		t.Fatal(err)
	}
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(runCtx) }()

	if err := placeOrder(ctx, db.Pool, Order{ID: "order-42", SKU: "book"}); err != nil {
		t.Fatal(err)
	}
	// Await the invoice and an empty outbox (the event and the saga command published).
	for {
		var invoices, pending int
		if err := db.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM invoice), (SELECT count(*) FROM onceflow.outbox)`).Scan(&invoices, &pending); err != nil {
			t.Fatal(err)
		}
		if invoices == 1 && pending == 0 {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("invoices = %d, outbox rows = %d; want 1 and 0", invoices, pending)
		}
		time.Sleep(20 * time.Millisecond)
	}
	admin, err := saga.NewAdmin("")
	if err != nil {
		t.Fatal(err)
	}
	if d, err := admin.Get(ctx, db.Pool, "order-42"); err != nil || d.State != saga.StateRunning || d.Step != "reserve-stock" {
		t.Fatalf("saga = %+v (%v), want running at reserve-stock", d, err)
	}

	stop()
	if err := <-relayDone; err != nil {
		t.Errorf("relay: %v", err)
	}
	if err := <-routerDone; err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("router: %v", err)
	}
	if err := router.Close(); err != nil {
		t.Errorf("close router: %v", err)
	}
	if err := sub.Close(); err != nil {
		t.Errorf("close subscriber: %v", err)
	}
}

// testing:begin

func TestInvoiceOnce(t *testing.T) {
	ctx := context.Background()
	db := onceflowtest.NewDB(t) // a fresh database with the onceflow schema; dropped after the test
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE invoice (event_id uuid PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{Pool: db.Pool, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	handle := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		_, err := outbox.MustTx(msg.Context()).Exec(msg.Context(), `INSERT INTO invoice (event_id) VALUES ($1)`, msg.UUID)
		return nil, err
	})
	msg := outbox.NewMessage([]byte(`{"id":"order-42"}`))
	for range 2 { // delivered twice
		if _, err := handle(msg.Copy()); err != nil {
			t.Fatal(err)
		}
	}
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM invoice`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("invoices = %d (%v), want 1", n, err)
	}
}

// testing:end
