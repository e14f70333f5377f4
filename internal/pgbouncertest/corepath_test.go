package pgbouncertest_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgbouncertest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
	"github.com/onceflow/onceflow/saga"
)

// order is the saga data and the orders.placed payload.
type order struct {
	ID string `json:"id"`
}

type stepResult struct {
	ID string `json:"id"`
}

// TestCorePathThroughPgBouncer runs the core path with every database client behind PgBouncer
// in transaction mode (a pool of 10 server connections shared by all of them), with the pgx
// settings docs/relay.md gives ("Connection poolers"): writers (outbox.WriteTx and
// saga.StartTx in business transactions), the relay (claims, deletes, leases through
// PgBouncer; its LISTEN on a direct connection, relay.Config.ListenConnConfig) to Kafka,
// an inbox consumer under a Watermill router (one transaction per message), a batched one
// (inboxkafka.BatchConsumer), and a two-step saga whose orchestrator consumes its replies in
// batches while one participant runs under the router and the other batched. Every fifth
// order's charge is declined, so its reservation is compensated. Every event must take
// effect once in each consumer, every saga finish with each effect once, the outbox drain.
func TestCorePathThroughPgBouncer(t *testing.T) {
	t.Parallel()
	corePath(t, pgx.QueryExecModeCacheDescribe)
}

func corePath(t *testing.T, mode pgx.QueryExecMode) {
	const (
		writers   = 4
		perWriter = 25
		orders    = writers * perWriter
	)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	db := testdb.New(t)
	b := pgbouncertest.Start(t, pgbouncertest.Options{PoolSize: 10})
	// Each component gets a pool of its own through PgBouncer, as separate services would.
	pool := func(maxConns int32) *pgxpool.Pool {
		return b.Pool(t, db, maxConns, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
	}
	brokers := kafkatest.Brokers(t, 4)
	placed := kafkatest.Topic("orders.placed")
	reserveT, releaseT, chargeT := kafkatest.Topic("cmd.reserve"), kafkatest.Topic("undo.reserve"), kafkatest.Topic("cmd.charge")
	effectT := db.Table("effect")
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE `+db.Table("orders")+` (id text PRIMARY KEY);
		CREATE TABLE `+effectT+` (kind text NOT NULL, id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	writer, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	logs := &testutil.SyncBuffer{}
	logger := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))

	def, err := saga.Define(kafkatest.Topic("checkout"), 1, []*saga.StepDef[order]{
		saga.Step[order]("reserve").
			Send(reserveT, func(o order) (any, error) { return o, nil }).
			Compensate(releaseT, func(o order) (any, error) { return o, nil }),
		saga.Step[order]("charge").
			Send(chargeT, func(o order) (any, error) { return o, nil }),
	})
	if err != nil {
		t.Fatal(err)
	}
	orch, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: pool(8), Schema: db.Schema, TimerInterval: 50 * time.Millisecond, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	if err := saga.Register(orch, def); err != nil {
		t.Fatal(err)
	}
	effect := func(ctx context.Context, tx pgx.Tx, kind, id string) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+effectT+` (kind, id) VALUES ($1, $2)`, kind, id)
		return err
	}
	reserveP, err := saga.NewParticipant(saga.ParticipantConfig{Pool: pool(8), Schema: db.Schema, Consumer: "inventory", Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	chargeP, err := saga.NewParticipant(saga.ParticipantConfig{Pool: pool(8), Schema: db.Schema, Consumer: "payments", Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	declined := func(id string) bool { var n int; _, _ = fmt.Sscanf(id, "o-%d", &n); return n%5 == 4 }

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	goRun := func(name string, run func(context.Context) error) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := run(runCtx); err != nil && !errors.Is(err, context.Canceled) {
				errs <- fmt.Errorf("%s: %w", name, err)
			}
		}()
	}

	// The relay: data path through PgBouncer, LISTEN directly on the server.
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: brokers})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sink.Close() }()
	listen, err := pgx.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	r, err := relay.New(relay.Config{Pool: pool(4), ListenConnConfig: listen, Sink: sink, Schema: db.Schema, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	goRun("relay", r.Run)
	goRun("orchestrator timers", orch.Run)

	// Consumers: a router (per message) and batched consumers.
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	subscriber := func(group string) message.Subscriber {
		sub, err := inboxkafka.NewSubscriber(brokers, group, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		return sub
	}
	billing, err := inbox.New(inbox.Config{Pool: pool(8), Schema: db.Schema, Consumer: "billing", Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	router.AddConsumerHandler("billing", placed, subscriber("billing"), func(msg *message.Message) error {
		return effect(msg.Context(), outbox.MustTx(msg.Context()), "billing", msg.UUID)
	}).AddMiddleware(billing.Middleware)
	router.AddConsumerHandler("reserve", reserveT, subscriber("inventory"), saga.Action(reserveP, func(ctx context.Context, tx pgx.Tx, o order) (stepResult, error) {
		return stepResult{ID: "r-" + o.ID}, effect(ctx, tx, "reserve", o.ID)
	}))
	router.AddConsumerHandler("release", releaseT, subscriber("inventory-undo"), saga.Compensation(reserveP, func(ctx context.Context, tx pgx.Tx, o order) error {
		return effect(ctx, tx, "release", o.ID)
	}))
	goRun("router", router.Run)

	shipping, err := inbox.New(inbox.Config{Pool: pool(8), Schema: db.Schema, Consumer: "shipping", Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	batched := func(group string, p inbox.BatchProcessor, topics ...string) {
		c, err := inboxkafka.NewBatchConsumer(inboxkafka.BatchConfig{Brokers: brokers, Group: group, Topics: topics, Processor: p,
			Backoff: 10 * time.Millisecond, Logger: logger})
		if err != nil {
			t.Fatal(err)
		}
		goRun(group, c.Run)
	}
	batched("shipping", shipping.BatchFunc("", func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) ([]*message.Message, error) {
		for _, m := range msgs {
			if err := effect(ctx, tx, "shipping", m.UUID); err != nil {
				return nil, err
			}
		}
		return nil, nil
	}), placed)
	batched("payments", saga.ActionProcessor(chargeP, func(ctx context.Context, tx pgx.Tx, o order) (stepResult, error) {
		if declined(o.ID) {
			return stepResult{}, saga.Fail("declined")
		}
		return stepResult{ID: "p-" + o.ID}, effect(ctx, tx, "charge", o.ID)
	}), chargeT)
	batched("orchestrator", orch, orch.ReplyTopics()...)
	<-router.Running()

	// Writers: business row, event and saga in one transaction each, through PgBouncer.
	events := make(chan string, orders)
	writersPool := pool(writers)
	var ww sync.WaitGroup
	for w := range writers {
		ww.Add(1)
		go func() {
			defer ww.Done()
			for i := range perWriter {
				id := fmt.Sprintf("o-%03d", w*perWriter+i)
				evt := outbox.SetPartitionKey(outbox.NewMessage([]byte(`{"id":"`+id+`"}`)), id)
				err := pgx.BeginFunc(ctx, writersPool, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, `INSERT INTO `+db.Table("orders")+` (id) VALUES ($1)`, id); err != nil {
						return err
					}
					if err := writer.WriteTx(ctx, tx, placed, evt); err != nil {
						return err
					}
					_, err := saga.StartTx(ctx, tx, def, order{ID: id}, saga.WithID(id), saga.WithWriter(writer))
					return err
				})
				if err != nil {
					errs <- fmt.Errorf("writer: %w", err)
					return
				}
				events <- evt.UUID
			}
		}()
	}
	ww.Wait()
	close(events)

	// Await: every saga finished and the outbox drained.
	admin, err := saga.NewAdmin(db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	unfinished := func() (n int, last string) {
		for i := range orders {
			id := fmt.Sprintf("o-%03d", i)
			d, err := admin.Get(ctx, db.Pool, id)
			if err != nil {
				return -1, err.Error()
			}
			if !d.State.Finished() {
				n, last = n+1, fmt.Sprintf("%s %s at %s", id, d.State, d.Step)
			}
		}
		return n, last
	}
	count := func(sql string) int {
		var n int
		if err := db.Pool.QueryRow(ctx, sql).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	testutil.AwaitWithin(t, 90*time.Second, "every saga finished, every event consumed, the outbox drained", func() bool {
		select {
		case err := <-errs:
			t.Fatal(err)
		default:
		}
		n, _ := unfinished()
		return n == 0 && count(`SELECT count(*) FROM `+db.Table("outbox")) == 0 &&
			count(`SELECT count(*) FROM `+effectT+` WHERE kind IN ('billing', 'shipping')`) >= 2*orders
	}, func() string {
		n, last := unfinished()
		return fmt.Sprintf("%d sagas unfinished (e.g. %s), %d outbox rows, effects %d; warnings:\n%s", n, last,
			count(`SELECT count(*) FROM `+db.Table("outbox")), count(`SELECT count(*) FROM `+effectT), logs.String())
	})

	// Exactly once: each event's effect once per consumer, each saga's effects once.
	want := map[string]int{}
	for id := range events {
		want["billing/"+id], want["shipping/"+id] = 1, 1
	}
	for i := range orders {
		id := fmt.Sprintf("o-%03d", i)
		want["reserve/"+id] = 1
		if declined(id) {
			want["release/"+id] = 1
		} else {
			want["charge/"+id] = 1
		}
	}
	got := map[string]int{}
	rows, err := db.Pool.Query(ctx, `SELECT kind || '/' || id FROM `+effectT)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var k string
		if err := rows.Scan(&k); err != nil {
			t.Fatal(err)
		}
		got[k]++
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for k, n := range want {
		if got[k] != n {
			t.Errorf("effect %s: %d times, want %d", k, got[k], n)
		}
	}
	for k, n := range got {
		if want[k] == 0 {
			t.Errorf("effect %s: %d times, want none", k, n)
		}
	}
	for i := range orders {
		id := fmt.Sprintf("o-%03d", i)
		d, err := admin.Get(ctx, db.Pool, id)
		if err != nil {
			t.Fatal(err)
		}
		if wantState := map[bool]saga.State{false: saga.StateCompleted, true: saga.StateCompensated}[declined(id)]; d.State != wantState {
			t.Errorf("saga %s: %s, want %s", id, d.State, wantState)
		}
	}

	stop()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if err := router.Close(); err != nil {
		t.Errorf("close router: %v", err)
	}
	// Warnings would say a statement failed through the pooler (a prepared statement that does
	// not exist, a LISTEN that hears nothing): none is expected.
	if s := logs.String(); s != "" {
		t.Errorf("warnings while running through PgBouncer:\n%s", s)
	}
}
