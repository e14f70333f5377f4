// program:begin

// Command sagaprogram is a whole saga program in one file: a checkout saga (reserve stock,
// then charge) with its orchestrator, two participants (inventory and payments) and the
// relay, one router with a consumer group per handler, and the shutdown order. It starts two
// sagas, one that completes and one that is compensated, and exits when both finished.
//
//	DATABASE_URL=postgres://... go run ./examples/sagaprogram   # KAFKA_BROKERS=host:9092 for a real Kafka
//
// In production the orchestrator and each participant are services of their own, each with
// its own relay (`onceflow relay`): see examples/orders, examples/inventory, examples/payments.
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
	"github.com/onceflow/onceflow/saga"
)

// Order is the saga's data.
type Order struct {
	ID          string
	SKU         string
	Quantity    int
	Amount      int
	Reservation string // set from the reserve-stock reply
}

// The commands and replies, as JSON.
type (
	ReserveStock struct {
		Order    string
		SKU      string
		Quantity int
	}
	Reserved     struct{ Reservation string }
	ReleaseStock struct{ Order string }
	Charge       struct {
		Order  string
		Amount int
	}
	Charged struct{ Payment string }
)

// checkout reserves stock, then charges; a declined charge releases the stock again.
var checkout = saga.MustDefine("checkout", 1, []*saga.StepDef[Order]{
	saga.Step[Order]("reserve-stock").
		Send("inventory.reserve", func(o Order) (any, error) {
			return ReserveStock{Order: o.ID, SKU: o.SKU, Quantity: o.Quantity}, nil
		}).
		OnReply(func(o *Order, r saga.Reply) error {
			var res Reserved
			if err := r.Decode(&res); err != nil {
				return err
			}
			o.Reservation = res.Reservation
			return nil
		}).
		Compensate("inventory.release", func(o Order) (any, error) {
			// By order, not o.Reservation: a reply that came too late never set it. release
			// learns the reservation from reserve's own result (saga.CompensationFor).
			return ReleaseStock{Order: o.ID}, nil
		}),
	saga.Step[Order]("charge").
		Send("payments.charge", func(o Order) (any, error) { return Charge{Order: o.ID, Amount: o.Amount}, nil }),
})

// topics are created before anything subscribes: a consumer group subscribed to a missing
// topic sits idle, and the relay keeps rows for a missing topic in the outbox.
var topics = []string{"inventory.reserve", "inventory.release", "payments.charge", "checkout.replies"}

// reserve is the inventory participant's action.
func reserve(ctx context.Context, tx pgx.Tx, cmd ReserveStock) (Reserved, error) {
	var left int
	if err := tx.QueryRow(ctx, `UPDATE stock SET quantity = quantity - $2 WHERE sku = $1 RETURNING quantity`,
		cmd.SKU, cmd.Quantity).Scan(&left); err != nil {
		return Reserved{}, err // rolled back and tried again, then answered as a failed attempt
	}
	if left < 0 {
		return Reserved{}, saga.Fail("out of stock") // rolled back; the saga compensates
	}
	var res Reserved
	err := tx.QueryRow(ctx, `INSERT INTO reservation (order_id, sku, quantity) VALUES ($1, $2, $3) RETURNING id::text`,
		cmd.Order, cmd.SKU, cmd.Quantity).Scan(&res.Reservation)
	return res, err
}

// release is its compensation; the barrier runs it only if reserve took effect, and done is
// what reserve returned (nil only once its barrier row expired: then release by order).
func release(ctx context.Context, tx pgx.Tx, cmd ReleaseStock, done *Reserved) error {
	which, key := `order_id = $1`, cmd.Order
	if done != nil {
		which, key = `id = $1::bigint`, done.Reservation
	}
	_, err := tx.Exec(ctx, `WITH r AS (DELETE FROM reservation WHERE `+which+` RETURNING sku, quantity)
		UPDATE stock SET quantity = stock.quantity + r.quantity FROM r WHERE stock.sku = r.sku`, key)
	return err
}

// charge is the payments participant's action: amounts over 100 are declined.
func charge(ctx context.Context, tx pgx.Tx, cmd Charge) (Charged, error) {
	if cmd.Amount > 100 {
		return Charged{}, saga.Fail("card declined")
	}
	var c Charged
	err := tx.QueryRow(ctx, `INSERT INTO payment (order_id, amount) VALUES ($1, $2) RETURNING id::text`, cmd.Order, cmd.Amount).Scan(&c.Payment)
	return c, err
}

func main() {
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if err := run(log); err != nil {
		log.Error("checkout: stopped", "err", err)
		os.Exit(1)
	}
}

func run(log *slog.Logger) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		return err
	}
	defer pool.Close()
	brokers, closeKafka, err := kafkaBrokers(ctx)
	if err != nil {
		return err
	}
	defer closeKafka()

	// 1. The schema (safe from every process at once) and the business tables.
	if _, err := migrations.Up(ctx, pool, migrations.Options{Logger: log}); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `
		CREATE TABLE IF NOT EXISTS stock (sku text PRIMARY KEY, quantity int NOT NULL);
		CREATE TABLE IF NOT EXISTS reservation (id bigserial PRIMARY KEY, order_id text, sku text, quantity int);
		CREATE TABLE IF NOT EXISTS payment (id bigserial PRIMARY KEY, order_id text, amount int);
		INSERT INTO stock VALUES ('book', 10) ON CONFLICT DO NOTHING`); err != nil {
		return err
	}

	// 2. The orchestrator and two participants (in a real system, three services).
	orch, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: pool, Logger: log})
	if err != nil {
		return err
	}
	if err := saga.Register(orch, checkout); err != nil {
		return err
	}
	inventory, err := saga.NewParticipant(saga.ParticipantConfig{Pool: pool, Consumer: "inventory", Logger: log})
	if err != nil {
		return err
	}
	payments, err := saga.NewParticipant(saga.ParticipantConfig{Pool: pool, Consumer: "payments", Logger: log})
	if err != nil {
		return err
	}
	// A service that does not migrate at start-up checks instead, and refuses to start.
	if err := errors.Join(orch.CheckSchema(ctx), inventory.CheckSchema(ctx), payments.CheckSchema(ctx)); err != nil {
		return err
	}

	// 3. One router; one subscriber, and so one consumer group, per handler.
	wlog := watermill.NewSlogLogger(log)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, wlog)
	if err != nil {
		return err
	}
	retry := middleware.Retry{MaxRetries: 3, InitialInterval: 100 * time.Millisecond, ShouldRetry: inbox.ShouldRetry}
	router.AddMiddleware(retry.Middleware, middleware.Recoverer)
	handlers := []struct {
		group, topic string
		handle       message.NoPublishHandlerFunc
	}{
		{"inventory.reserve", "inventory.reserve", saga.Action(inventory, reserve)},
		{"inventory.release", "inventory.release", saga.CompensationFor(inventory, release)},
		{"payments.charge", "payments.charge", saga.Action(payments, charge)},
	}
	for _, topic := range orch.ReplyTopics() { // "checkout.replies"
		handlers = append(handlers, struct {
			group, topic string
			handle       message.NoPublishHandlerFunc
		}{"orchestrator." + topic, topic, orch.Handler})
	}
	for _, h := range handlers {
		sub, err := inboxkafka.NewSubscriber(brokers, h.group, wlog)
		if err != nil {
			return err
		}
		router.AddConsumerHandler(h.group, h.topic, sub, h.handle)
	}

	// 4. Run the relay, the orchestrator's timers and the router until one of them stops or
	// ctx ends, then stop the others and wait for each. Each commits what it has done (a
	// handler's transaction, a relay batch) before it returns: a message not consumed yet is
	// redelivered after a restart, a row not published yet stays in the outbox until then.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i, run := range []func(context.Context) error{
		func(ctx context.Context) error { return runRelay(ctx, pool, brokers, log) },
		orch.Run,
		router.Run,
		// 5. Start two sagas once the handlers run: one completes, one is compensated. A demo
		// stops when both finished; a service would run until SIGTERM.
		func(ctx context.Context) error {
			select {
			case <-router.Running():
				return placeOrders(ctx, pool, log)
			case <-ctx.Done():
				return nil
			}
		},
	} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer cancel() // the first to return stops the others
			errs[i] = run(ctx)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// placeOrders starts a saga per order, each in the business transaction that writes the
// order, and waits until both finished.
func placeOrders(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger) error {
	orders := []Order{
		{ID: "order-1", SKU: "book", Quantity: 2, Amount: 40},  // completes
		{ID: "order-2", SKU: "book", Quantity: 1, Amount: 500}, // declined: the stock is released
	}
	for _, o := range orders {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			// The order row would be written here, in the same transaction.
			_, err := saga.StartTx(ctx, tx, checkout, o, saga.WithID(o.ID))
			return err
		})
		if err != nil {
			return err
		}
	}
	admin, err := saga.NewAdmin("")
	if err != nil {
		return err
	}
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for _, o := range orders {
		for {
			d, err := admin.Get(ctx, pool, o.ID)
			if err != nil {
				return err
			}
			if d.State.Finished() {
				log.Info("saga finished", "id", o.ID, "state", d.State, "error", d.Error)
				break
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-t.C:
			}
		}
	}
	return nil
}

// runRelay publishes the outbox to Kafka until ctx ends (or run `onceflow relay`).
func runRelay(ctx context.Context, pool *pgxpool.Pool, brokers []string, log *slog.Logger) error {
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: brokers})
	if err != nil {
		return err
	}
	r, err := relay.New(relay.Config{Pool: pool, Sink: sink, Logger: log})
	if err != nil {
		return errors.Join(err, sink.Close())
	}
	return errors.Join(r.Run(ctx), sink.Close())
}

// kafkaBrokers returns KAFKA_BROKERS, or starts an in-process Kafka (kfake) when it is unset,
// and creates the topics.
func kafkaBrokers(ctx context.Context) ([]string, func(), error) {
	closeKafka := func() {}
	brokers := strings.Split(os.Getenv("KAFKA_BROKERS"), ",")
	if brokers[0] == "" {
		cluster, err := kfake.NewCluster(kfake.NumBrokers(1))
		if err != nil {
			return nil, nil, err
		}
		brokers, closeKafka = cluster.ListenAddrs(), cluster.Close
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		closeKafka()
		return nil, nil, err
	}
	defer cl.Close()
	resp, err := kadm.NewClient(cl).CreateTopics(ctx, 4, -1, nil, topics...)
	if err == nil {
		for _, t := range resp.Sorted() {
			if t.Err != nil && !errors.Is(t.Err, kerr.TopicAlreadyExists) {
				err = errors.Join(err, fmt.Errorf("create topic %s: %w", t.Topic, t.Err))
			}
		}
	}
	if err != nil {
		closeKafka()
		return nil, nil, err
	}
	return brokers, closeKafka, nil
}

// program:end
