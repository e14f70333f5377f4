package saga_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/stdlib"

	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/saga"
	"github.com/onceflow/onceflow/saga/sagatest"
)

// Start a saga from code written against database/sql: StartSQLTx takes the *sql.Tx the
// business write already runs in (any PostgreSQL driver; here pgx's stdlib over the service's
// pgxpool, so both share one pool). The order row, the saga row and its first command commit
// together; a retried start with the same id is a no-op; a rolled-back one leaves nothing.
func ExampleStartSQLTx() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{NoKafka: true}) // a throwaway, migrated database
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	if err := createShop(ctx, env.Pool); err != nil {
		fmt.Println(err)
		return
	}
	db := stdlib.OpenDBFromPool(env.Pool) // database/sql on the same pool (or sql.Open("postgres", url) with lib/pq)
	defer db.Close()

	placeOrder := func(p Purchase, fail error) (string, error) {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return "", err
		}
		defer tx.Rollback() //nolint:errcheck // a no-op after Commit
		if _, err := tx.ExecContext(ctx, `INSERT INTO orders (id, amount) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING`, p.OrderID, p.Amount); err != nil {
			return "", err
		}
		id, err := saga.StartSQLTx(ctx, tx, purchase, p, saga.WithID(p.OrderID))
		if err != nil {
			return "", err
		}
		if fail != nil {
			return "", fail // rolls back the order and the saga together
		}
		return id, tx.Commit()
	}
	fmt.Println(placeOrder(Purchase{OrderID: "order-1", SKU: "book", Quantity: 2, Amount: 30}, nil))
	fmt.Println(placeOrder(Purchase{OrderID: "order-1", SKU: "book", Quantity: 2, Amount: 30}, nil)) // retried: no second saga
	fmt.Println(placeOrder(Purchase{OrderID: "order-3", SKU: "book", Quantity: 1, Amount: 10}, errors.New("card expired")))

	// The orchestrator and participants run as usual (here in-process through sagatest.Bus).
	orch, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: env.Pool})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := saga.Register(orch, purchase); err != nil {
		fmt.Println(err)
		return
	}
	bus := sagatest.NewBus(env.Pool, env.Schema)
	bus.Orchestrate(orch)
	if err := subscribeParticipants(bus, env.Pool, nil); err != nil {
		fmt.Println(err)
		return
	}
	admin, err := saga.NewAdmin("")
	if err != nil {
		fmt.Println(err)
		return
	}
	state := func(id string) saga.State {
		d, err := admin.Get(ctx, env.Pool, id)
		if err != nil {
			return saga.State(err.Error())
		}
		return d.State
	}
	fmt.Println("run:", bus.RunUntil(ctx, func() bool { return state("order-1").Finished() }))
	fmt.Println("order-1:", state("order-1"))
	var sagas int
	_ = db.QueryRowContext(ctx, `SELECT count(*) FROM onceflow.saga`).Scan(&sagas)
	fmt.Println("sagas:", sagas)
	// Output:
	// order-1 <nil>
	// order-1 <nil>
	//  card expired
	// run: <nil>
	// order-1: completed
	// sagas: 1
}
