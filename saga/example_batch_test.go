package saga_test

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/saga"
	"github.com/onceflow/onceflow/saga/sagatest"
)

// The participants and the orchestrator as batch processors, for
// inboxkafka.BatchConsumer: each batch of commands runs in one transaction (dedup keys, the
// barrier and every reply in a few statements), each batch of replies too. Here sagatest.Bus
// hands each topic's pending messages over as one batch; in a service:
//
//	c, err := inboxkafka.NewBatchConsumer(inboxkafka.BatchConfig{Brokers: brokers,
//		Group: "inventory.reserve", Topics: []string{"inventory.reserve"},
//		Processor: saga.ActionProcessor(inventory, reserve)})
func ExampleActionProcessor() {
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
	inventory, err2 := saga.NewParticipant(saga.ParticipantConfig{Pool: pool, Consumer: "inventory"})
	payments, err3 := saga.NewParticipant(saga.ParticipantConfig{Pool: pool, Consumer: "payments"})
	if err != nil || err2 != nil || err3 != nil {
		fmt.Println(err, err2, err3)
		return
	}
	bus := sagatest.NewBus(pool, env.Schema)
	bus.OrchestrateBatched(orch) // the orchestrator is an inbox.BatchProcessor
	bus.SubscribeBatch("inventory.reserve", saga.ActionProcessor(inventory,
		func(ctx context.Context, tx pgx.Tx, cmd ReserveStock) (Reserved, error) {
			tag, err := tx.Exec(ctx, `UPDATE stock SET available = available - $2 WHERE sku = $1 AND available >= $2`, cmd.SKU, cmd.Quantity)
			if err != nil {
				return Reserved{}, err
			}
			if tag.RowsAffected() == 0 {
				return Reserved{}, saga.Fail("out of stock")
			}
			var res Reserved
			err = tx.QueryRow(ctx, `INSERT INTO reservation (order_id, sku, quantity) VALUES ($1, $2, $3) RETURNING id`,
				cmd.OrderID, cmd.SKU, cmd.Quantity).Scan(&res.ReservationID)
			return res, err
		}))
	bus.SubscribeBatch("inventory.release", saga.CompensationProcessor(inventory,
		func(ctx context.Context, tx pgx.Tx, cmd ReleaseStock) error {
			_, err := tx.Exec(ctx, `WITH r AS (DELETE FROM reservation WHERE id = $1 RETURNING sku, quantity)
				UPDATE stock SET available = available + r.quantity FROM r WHERE stock.sku = r.sku`, cmd.ReservationID)
			return err
		}))
	bus.SubscribeBatch("payments.charge", saga.ActionProcessor(payments,
		func(ctx context.Context, tx pgx.Tx, cmd ChargeCard) (Charged, error) {
			if cmd.Amount > 100 {
				return Charged{}, saga.Fail("declined: over the customer's limit")
			}
			var res Charged
			err := tx.QueryRow(ctx, `INSERT INTO payment (order_id, amount) VALUES ($1, $2) RETURNING id`, cmd.OrderID, cmd.Amount).Scan(&res.PaymentID)
			return res, err
		}))

	// Three orders at once: their commands and replies travel in batches.
	for i, amount := range []int{40, 500, 60} {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			id := fmt.Sprintf("order-%d", i+1)
			_, err := saga.StartTx(ctx, tx, purchase, Purchase{OrderID: id, SKU: "book", Quantity: 1, Amount: amount}, saga.WithID(id))
			return err
		})
		if err != nil {
			fmt.Println(err)
			return
		}
	}
	admin, _ := saga.NewAdmin("")
	err = bus.RunUntil(ctx, func() bool {
		list, err := admin.List(ctx, pool, saga.ListFilter{})
		finished := 0
		for _, s := range list {
			if s.State.Finished() {
				finished++
			}
		}
		return err == nil && finished == 3
	})
	for _, id := range []string{"order-1", "order-2", "order-3"} {
		d, _ := admin.Get(ctx, pool, id)
		fmt.Println(id, d.State)
	}
	var available int
	_ = pool.QueryRow(ctx, `SELECT available FROM stock WHERE sku = 'book'`).Scan(&available)
	fmt.Println("books available:", available, err)
	// Output:
	// order-1 completed
	// order-2 compensated
	// order-3 completed
	// books available: 8 <nil>
}

// Order is the saga data of the local-step example.
type Order struct {
	ID        string `json:"id"`
	Confirmed bool   `json:"confirmed"`
}

// A local step runs in the orchestrator's own transaction — the transition's — instead of
// being sent to a participant: no command, no reply, no barrier, exactly once by
// construction. Here the order is placed and confirmed locally, around a remote charge.
// OnReplyTx is a reply handler in the same transaction: it writes the payment id into the
// orders table as the charge's reply is applied.
func ExampleStepDef_Local() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{NoKafka: true})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	pool := env.Pool
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (id text PRIMARY KEY, state text NOT NULL, payment_id bigint);
		CREATE TABLE payment (id bigserial PRIMARY KEY, order_id text NOT NULL UNIQUE)`); err != nil {
		fmt.Println(err)
		return
	}
	checkout := saga.MustDefine("checkout", 1, []*saga.StepDef[Order]{
		saga.Step[Order]("place").
			Local(func(ctx context.Context, tx pgx.Tx, o *Order) error {
				_, err := tx.Exec(ctx, `INSERT INTO orders (id, state) VALUES ($1, 'placed')`, o.ID)
				return err
			}).
			CompensateLocal(func(ctx context.Context, tx pgx.Tx, o *Order) error {
				_, err := tx.Exec(ctx, `UPDATE orders SET state = 'cancelled' WHERE id = $1`, o.ID)
				return err
			}),
		saga.Step[Order]("charge").
			Send("payments.charge", func(o Order) (any, error) { return ChargeCard{OrderID: o.ID, Amount: 10}, nil }).
			OnReplyTx(func(ctx context.Context, tx pgx.Tx, o *Order, r saga.Reply) error {
				var c Charged
				if err := r.Decode(&c); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, `UPDATE orders SET payment_id = $2 WHERE id = $1`, o.ID, c.PaymentID)
				return err
			}),
		saga.Step[Order]("confirm").
			Local(func(ctx context.Context, tx pgx.Tx, o *Order) error {
				o.Confirmed = true
				_, err := tx.Exec(ctx, `UPDATE orders SET state = 'confirmed' WHERE id = $1`, o.ID)
				return err
			}),
	})
	orch, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: pool})
	if err == nil {
		err = saga.Register(orch, checkout)
	}
	payments, err2 := saga.NewParticipant(saga.ParticipantConfig{Pool: pool, Consumer: "payments"})
	if err != nil || err2 != nil {
		fmt.Println(err, err2)
		return
	}
	bus := sagatest.NewBus(pool, env.Schema)
	bus.Orchestrate(orch)
	bus.Subscribe("payments.charge", saga.Action(payments, func(ctx context.Context, tx pgx.Tx, cmd ChargeCard) (Charged, error) {
		var res Charged
		err := tx.QueryRow(ctx, `INSERT INTO payment (order_id) VALUES ($1) RETURNING id`, cmd.OrderID).Scan(&res.PaymentID)
		return res, err
	}))
	// RunLocalSteps: the first local step runs in the business transaction itself.
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := saga.StartTx(ctx, tx, checkout, Order{ID: "o-1"}, saga.WithID("o-1"), saga.RunLocalSteps())
		return err
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	admin, _ := saga.NewAdmin("")
	err = bus.RunUntil(ctx, func() bool {
		d, err := admin.Get(ctx, pool, "o-1")
		return err == nil && d.State.Finished()
	})
	d, _ := admin.Get(ctx, pool, "o-1")
	var state string
	var paid bool
	_ = pool.QueryRow(ctx, `SELECT state, payment_id IS NOT NULL FROM orders WHERE id = 'o-1'`).Scan(&state, &paid)
	fmt.Println(d.State, err, "order:", state, "paid:", paid)
	// Output:
	// completed <nil> order: confirmed paid: true
}
