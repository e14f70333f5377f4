package inbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
)

// The bridge for a service written against database/sql: one pgxpool serves both worlds.
// stdlib.OpenDBFromPool(pool) gives the service's database/sql code (repositories, HTTP
// handlers, outbox.WriteSQLTx, saga.StartSQLTx) a *sql.DB over the same connections the
// inbox uses. A handler behind the inbox runs its statements on the inbox's transaction, a
// pgx.Tx: the SQL text stays the same, ExecContext becomes Exec, QueryRowContext QueryRow.
func Example_databaseSQL() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{NoKafka: true}) // a throwaway, migrated database
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	pool := env.Pool
	db := stdlib.OpenDBFromPool(pool) // database/sql over the inbox's pool: one pool to size
	defer db.Close()

	// The service's existing repository, written against database/sql.
	type execer interface {
		ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	}
	const addPoints = `INSERT INTO points (customer, points) VALUES ($1, $2)
		ON CONFLICT (customer) DO UPDATE SET points = points.points + EXCLUDED.points`
	legacyAddPoints := func(ctx context.Context, q execer, customer string, n int) error {
		_, err := q.ExecContext(ctx, addPoints, customer, n)
		return err
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE points (customer text PRIMARY KEY, points int NOT NULL)`); err != nil {
		fmt.Println(err)
		return
	}
	if err := legacyAddPoints(ctx, db, "ada", 10); err != nil { // database/sql, outside any handler
		fmt.Println(err)
		return
	}

	metrics := &inbox.Counters{}
	ib, err := inbox.New(inbox.Config{Pool: pool, Consumer: "loyalty", Metrics: metrics})
	if err != nil {
		fmt.Println(err)
		return
	}
	logger := watermill.NopLogger{}
	broker := gochannel.NewGoChannel(gochannel.Config{}, logger)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		fmt.Println(err)
		return
	}
	router.AddMiddleware(ib.Middleware)
	router.AddConsumerHandler("loyalty", "orders.placed", broker, func(msg *message.Message) error {
		// The same statement on the inbox's transaction (a pgx.Tx): it commits with the dedup row.
		tx := outbox.MustTx(msg.Context())
		_, err := tx.Exec(msg.Context(), addPoints, "ada", 5)
		return err
	})
	go func() { _ = router.Run(ctx) }()
	defer router.Close()
	<-router.Running()

	order := outbox.NewMessage([]byte(`{"customer":"ada"}`))
	for range 2 {
		_ = broker.Publish("orders.placed", order.Copy()) // delivered twice: applied once
	}
	for s := metrics.Snapshot(); s.Processed+s.Duplicates < 2; s = metrics.Snapshot() {
		time.Sleep(10 * time.Millisecond) // a test would wait with a deadline
	}
	var points int
	_ = db.QueryRowContext(ctx, `SELECT points FROM points WHERE customer = 'ada'`).Scan(&points)
	fmt.Println("points:", points)
	// Output:
	// points: 15
}
