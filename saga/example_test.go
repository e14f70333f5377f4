package saga_test

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/saga"
	"github.com/onceflow/onceflow/saga/sagatest"
)

// Purchase is the data of the examples' saga: what its commands are built from.
type Purchase struct {
	OrderID       string `json:"order_id"`
	SKU           string `json:"sku"`
	Quantity      int    `json:"quantity"`
	Amount        int    `json:"amount"`
	ReservationID int64  `json:"reservation_id,omitempty"`
}

// The commands and replies exchanged with the participants (JSON on the wire).
type (
	ReserveStock struct {
		OrderID  string `json:"order_id"`
		SKU      string `json:"sku"`
		Quantity int    `json:"quantity"`
	}
	Reserved struct {
		ReservationID int64 `json:"reservation_id"`
	}
	ReleaseStock struct {
		ReservationID int64 `json:"reservation_id"`
	}
	ChargeCard struct {
		OrderID string `json:"order_id"`
		Amount  int    `json:"amount"`
	}
	Charged struct {
		PaymentID int64 `json:"payment_id"`
	}
)

// purchase reserves stock (compensated by releasing it), then charges the card.
var purchase = saga.MustDefine("purchase", 1, []*saga.StepDef[Purchase]{
	saga.Step[Purchase]("reserve-stock").
		Send("inventory.reserve", func(p Purchase) (any, error) {
			return ReserveStock{OrderID: p.OrderID, SKU: p.SKU, Quantity: p.Quantity}, nil
		}).
		OnReply(func(p *Purchase, r saga.Reply) error {
			var res Reserved
			if err := r.Decode(&res); err != nil {
				return err
			}
			p.ReservationID = res.ReservationID // the compensation needs it
			return nil
		}).
		Compensate("inventory.release", func(p Purchase) (any, error) {
			return ReleaseStock{ReservationID: p.ReservationID}, nil
		}),
	saga.Step[Purchase]("charge").
		Send("payments.charge", func(p Purchase) (any, error) {
			return ChargeCard{OrderID: p.OrderID, Amount: p.Amount}, nil
		}),
})

// Start a saga in the business transaction: the order row, the saga row and its first command
// (in the outbox) commit together. With WithID, a retried start is a no-op. Here
// sagatest.Bus carries the commands and replies in-process; in production the relay and
// Kafka do, and the orchestrator's Handler and Run consume the replies and fire the timers.
func ExampleStartTx() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{NoKafka: true}) // a throwaway, migrated database
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	pool := env.Pool
	if err := createShop(ctx, pool); err != nil {
		fmt.Println(err)
		return
	}

	orch, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: pool})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := saga.Register(orch, purchase); err != nil {
		fmt.Println(err)
		return
	}
	bus := sagatest.NewBus(pool, env.Schema) // stands in for the relay and Kafka
	bus.Orchestrate(orch)
	if err := subscribeParticipants(bus, pool, nil); err != nil {
		fmt.Println(err)
		return
	}

	placeOrder := func(p Purchase) (string, error) {
		var id string
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO orders (id, amount) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING`, p.OrderID, p.Amount); err != nil {
				return err
			}
			var err error
			id, err = saga.StartTx(ctx, tx, purchase, p, saga.WithID(p.OrderID))
			return err
		})
		return id, err
	}
	for _, p := range []Purchase{
		{OrderID: "order-1", SKU: "book", Quantity: 2, Amount: 30},
		{OrderID: "order-1", SKU: "book", Quantity: 2, Amount: 30},  // a retried request: no second saga
		{OrderID: "order-2", SKU: "book", Quantity: 1, Amount: 500}, // the payment is declined
	} {
		id, err := placeOrder(p)
		fmt.Println("started:", id, err)
	}

	admin, err := saga.NewAdmin("")
	if err != nil {
		fmt.Println(err)
		return
	}
	state := func(id string) saga.State {
		d, err := admin.Get(ctx, pool, id)
		if err != nil {
			return saga.State(err.Error())
		}
		return d.State
	}
	err = bus.RunUntil(ctx, func() bool { return state("order-1").Finished() && state("order-2").Finished() })
	fmt.Println("run:", err)
	fmt.Println("order-1:", state("order-1"))
	fmt.Println("order-2:", state("order-2"))
	var available int
	_ = pool.QueryRow(ctx, `SELECT available FROM stock WHERE sku = 'book'`).Scan(&available)
	fmt.Println("books available:", available) // 10 - 2; order-2's reservation was released
	// Output:
	// started: order-1 <nil>
	// started: order-1 <nil>
	// started: order-2 <nil>
	// run: <nil>
	// order-1: completed
	// order-2: compensated
	// books available: 8
}

// A participant turns typed handlers into Watermill handlers (message.NoPublishHandlerFunc):
// each command runs in one transaction with its dedup row, the barrier's rows, the handler's
// writes and the reply (in the outbox). Here every command and reply is delivered twice, and
// the stock is still reserved once. In a service, register the handlers with
// router.AddConsumerHandler on a Kafka subscriber, without the inbox middleware.
func ExampleAction() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{NoKafka: true})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	pool := env.Pool
	if err := createShop(ctx, pool); err != nil {
		fmt.Println(err)
		return
	}
	orch, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: pool})
	if err == nil {
		err = saga.Register(orch, purchase)
	}
	if err != nil {
		fmt.Println(err)
		return
	}
	bus := sagatest.NewBus(pool, env.Schema)
	bus.DeliverTwice = true // like a broker redelivering every message
	bus.Orchestrate(orch)
	metrics := &saga.Counters{}
	if err := subscribeParticipants(bus, pool, metrics); err != nil {
		fmt.Println(err)
		return
	}

	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := saga.StartTx(ctx, tx, purchase, Purchase{OrderID: "order-7", SKU: "book", Quantity: 3, Amount: 40}, saga.WithID("order-7"))
		return err
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	admin, _ := saga.NewAdmin("")
	err = bus.RunUntil(ctx, func() bool {
		d, err := admin.Get(ctx, pool, "order-7")
		return err == nil && d.State.Finished()
	})
	d, _ := admin.Get(ctx, pool, "order-7")
	var available, reservations, payments int
	_ = pool.QueryRow(ctx, `SELECT available FROM stock WHERE sku = 'book'`).Scan(&available)
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM reservation`).Scan(&reservations)
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM payment`).Scan(&payments)
	fmt.Println(d.State, err)
	fmt.Println("books available:", available, "reservations:", reservations, "payments:", payments)
	fmt.Println("duplicate commands skipped:", metrics.Snapshot().Duplicates)
	// Output:
	// completed <nil>
	// books available: 7 reservations: 1 payments: 1
	// duplicate commands skipped: 2
}

// createShop creates the participants' tables (in a real system each service has its own
// database) and puts 10 books in stock.
func createShop(ctx context.Context, pool *pgxpool.Pool) error {
	_, err := pool.Exec(ctx, `
		CREATE TABLE orders (id text PRIMARY KEY, amount int NOT NULL);
		CREATE TABLE stock (sku text PRIMARY KEY, available int NOT NULL CHECK (available >= 0));
		CREATE TABLE reservation (id bigserial PRIMARY KEY, order_id text NOT NULL, sku text NOT NULL, quantity int NOT NULL);
		CREATE TABLE payment (id bigserial PRIMARY KEY, order_id text NOT NULL UNIQUE, amount int NOT NULL);
		INSERT INTO stock VALUES ('book', 10);`)
	return err
}

// subscribeParticipants builds the inventory and payments participants and subscribes their
// handlers to the saga's command topics.
func subscribeParticipants(bus *sagatest.Bus, pool *pgxpool.Pool, metrics saga.Metrics) error {
	inventory, err := saga.NewParticipant(saga.ParticipantConfig{Pool: pool, Consumer: "inventory", Metrics: metrics})
	if err != nil {
		return err
	}
	payments, err := saga.NewParticipant(saga.ParticipantConfig{Pool: pool, Consumer: "payments", Metrics: metrics})
	if err != nil {
		return err
	}
	bus.Subscribe("inventory.reserve", saga.Action(inventory,
		func(ctx context.Context, tx pgx.Tx, cmd ReserveStock) (Reserved, error) {
			tag, err := tx.Exec(ctx, `UPDATE stock SET available = available - $2 WHERE sku = $1 AND available >= $2`, cmd.SKU, cmd.Quantity)
			if err != nil {
				return Reserved{}, err // infrastructure error: rolled back and redelivered, nothing replied
			}
			if tag.RowsAffected() == 0 {
				return Reserved{}, saga.Fail("out of stock") // business failure: the saga compensates
			}
			var res Reserved
			err = tx.QueryRow(ctx, `INSERT INTO reservation (order_id, sku, quantity) VALUES ($1, $2, $3) RETURNING id`,
				cmd.OrderID, cmd.SKU, cmd.Quantity).Scan(&res.ReservationID)
			return res, err // the reply's payload
		}))
	bus.Subscribe("inventory.release", saga.Compensation(inventory,
		func(ctx context.Context, tx pgx.Tx, cmd ReleaseStock) error {
			_, err := tx.Exec(ctx, `WITH r AS (DELETE FROM reservation WHERE id = $1 RETURNING sku, quantity)
				UPDATE stock SET available = available + r.quantity FROM r WHERE stock.sku = r.sku`, cmd.ReservationID)
			return err
		}))
	bus.Subscribe("payments.charge", saga.Action(payments,
		func(ctx context.Context, tx pgx.Tx, cmd ChargeCard) (Charged, error) {
			if cmd.Amount > 100 {
				return Charged{}, saga.Fail("declined: over the customer's limit")
			}
			var res Charged
			err := tx.QueryRow(ctx, `INSERT INTO payment (order_id, amount) VALUES ($1, $2) RETURNING id`,
				cmd.OrderID, cmd.Amount).Scan(&res.PaymentID)
			return res, err
		}))
	return nil
}
