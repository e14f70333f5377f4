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
	cfg.Logger = testLogger(t)
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
