package relay_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// roundTrips counts the statements and pipelined batches a pool sends: one per round trip.
type roundTrips struct{ n atomic.Int64 }

func (c *roundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *roundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (c *roundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *roundTrips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (c *roundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// relayPool is a pool of its own for the relay, tagged so tests can find its connections.
func relayPool(t testing.TB, db *testdb.DB, tracer pgx.QueryTracer) (*pgxpool.Pool, string) {
	t.Helper()
	app := "relay-" + db.Schema
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	cfg.ConnConfig.Tracer = tracer
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, app
}

func newRelayOnPool(t testing.TB, pool *pgxpool.Pool, db *testdb.DB, brokers []string, cfg relay.Config) *relay.Relay {
	t.Helper()
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: brokers})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sink.Close() })
	cfg.Schema = db.Schema
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	cfg.Pool, cfg.Sink = pool, sink
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestWakeUpByNotify: with polling effectively off (one poll an hour), rows are still
// published at once, woken by LISTEN/NOTIFY; a single notification for a large transaction
// drains it completely, because a full batch is followed by the next claim immediately; and
// after its listening connection is killed the relay reconnects and keeps waking up.
func TestWakeUpByNotify(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 1)
	topic := kafkatest.Topic("notify")
	pool, app := relayPool(t, db, nil)
	c := newConsumer(t, brokers, topic)
	rec := newRecorder()
	startRelay(t, newRelayOnPool(t, pool, db, brokers, relay.Config{PollInterval: time.Hour, BatchSize: 100, Metrics: rec}))
	rec.waitFor(t, 30*time.Second, "shards owned", func(r *recorder) bool { return r.owned > 0 })

	one := writeEventsPrefix(t, db, topic, 1, 1, 1, "one-")
	c.waitDistinct(t, 1, 30*time.Second)
	big := writeEventsPrefix(t, db, topic, 2500, 10, 2500, "big-") // one transaction, one notification, 25 batches
	got := c.waitDistinct(t, 1+len(big), 60*time.Second)
	checkDelivery(t, append(one, big...), got)

	listening := func() int {
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'`, app).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	eventually(t, 30*time.Second, "the listener connection", func() bool { return listening() == 1 })
	if _, err := db.Pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'`, app); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "the listener to reconnect", func() bool { return listening() == 1 })
	after := writeEventsPrefix(t, db, topic, 5, 5, 1, "after-")
	got = c.waitDistinct(t, 1+len(big)+len(after), 30*time.Second)
	checkDelivery(t, append(append(one, big...), after...), got)
}

// asleep reports whether a relay of the schema is marked asleep (writers notify it).
func asleep(t testing.TB, db *testdb.DB) bool {
	t.Helper()
	var n int
	if err := db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM `+db.Schema+`.relay_member WHERE asleep_until > now()`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n > 0
}

// TestIdleCost: an idle relay with the default settings costs about one database round trip
// per second once asleep: a claim per PollInterval (1 s) and one pipelined lease renewal per
// LeaseDuration/4 (2 s).
func TestIdleCost(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 1)
	trips := &roundTrips{}
	pool, _ := relayPool(t, db, trips)
	rec := newRecorder()
	startRelay(t, newRelayOnPool(t, pool, db, brokers, relay.Config{Metrics: rec, StatsInterval: -1}))
	rec.waitFor(t, 30*time.Second, "shards owned", func(r *recorder) bool { return r.owned == 64 })
	// After 25ms without rows (and 20ms more of tight polling) the relay goes to sleep.
	eventually(t, 30*time.Second, "the relay to sleep", func() bool { return asleep(t, db) })
	// Past the grace period of tight polls after falling asleep and the few polls that follow
	// (8, 32, 128, 512 ms): a steady state, not an event to await.
	time.Sleep(time.Second)
	window := 6 * time.Second
	if inCI() {
		window = 4 * time.Second
	}
	start, n0 := time.Now(), trips.n.Load()
	time.Sleep(window) // measuring a rate over a window, not waiting for an event
	perSecond := float64(trips.n.Load()-n0) / time.Since(start).Seconds()
	t.Logf("idle relay: %.2f database round trips per second", perSecond)
	if perSecond > 2 {
		t.Fatalf("idle relay makes %.2f round trips per second, want about one (≤ 2)", perSecond)
	}
}

// blockingSink holds every Publish call until released (or the batch is cancelled), as a
// stalled broker does until the producer's delivery timeout; then it acknowledges everything.
type blockingSink struct {
	entered chan struct{} // one value per Publish call, sent when it starts waiting
	release chan struct{} // closed to let every call through
}

func (s *blockingSink) Publish(ctx context.Context, msgs []*relay.Message, errs []error) {
	select {
	case s.entered <- struct{}{}:
	default:
	}
	select {
	case <-s.release:
	case <-ctx.Done():
		for i := range errs {
			errs[i] = ctx.Err()
		}
	}
}

func (s *blockingSink) Close() error { return nil }

// TestWokenRelayClearsItsAsleepMarkBeforePublishing: a relay woken from sleep clears its
// asleep mark as soon as it found rows, not when its first batch is acknowledged. While that
// batch waits on a stalled broker, writers must not go on sending a NOTIFY with every commit
// (each takes PostgreSQL's cluster-wide notify lock at commit, serialising the writers).
func TestWokenRelayClearsItsAsleepMarkBeforePublishing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	sink := &blockingSink{entered: make(chan struct{}, 1), release: make(chan struct{})}
	rec := newRecorder()
	r, err := relay.New(relay.Config{Schema: db.Schema, Pool: db.Pool, Sink: sink, Metrics: rec, Logger: testLogger(t), StatsInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	stop := startRelay(t, r)
	defer stop()
	defer close(sink.release) // runs before stop: the batch in flight completes
	rec.waitFor(t, 30*time.Second, "shards owned", func(r *recorder) bool { return r.owned > 0 })
	eventually(t, 30*time.Second, "the relay to sleep", func() bool { return asleep(t, db) })

	listener, err := pgx.Connect(ctx, db.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = listener.Close(ctx) }()
	if _, err := listener.Exec(ctx, "LISTEN "+pgx.Identifier{outbox.NotifyChannel(db.Schema)}.Sanitize()); err != nil {
		t.Fatal(err)
	}

	writeEvents(t, db, "stalled", 1, 1, 1) // notifies the sleeping relay, which wakes and publishes
	select {
	case <-sink.entered:
	case <-time.After(30 * time.Second):
		t.Fatal("the woken relay never published")
	}
	// Drain the wake-up notification itself.
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	_, err = listener.WaitForNotification(wctx)
	cancel()
	if err != nil {
		t.Fatalf("the first write did not notify the sleeping relay: %v", err)
	}
	eventually(t, 5*time.Second, "the asleep mark to clear while the batch is in flight", func() bool { return !asleep(t, db) })

	// The batch is still stuck in the sink; commits made now must not notify.
	const commits = 30
	writeEventsPrefix(t, db, "stalled", commits, commits, 1, "during-")
	notified := 0
	for {
		short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		_, err := listener.WaitForNotification(short)
		cancel()
		if err != nil {
			break
		}
		notified++
	}
	if notified > 0 {
		t.Fatalf("%d of %d commits sent a NOTIFY while the woken relay's first batch was in flight, want 0", notified, commits)
	}
}
