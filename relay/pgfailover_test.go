package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/relay"
)

// TestRelayFollowsAFailoverToAStandbyThatLagged: the relay's claim cursor (an outbox id and the
// snapshot of the claim that set it) belongs to one server. An asynchronous standby promoted
// after its primary died lacks the primary's last commits: its outbox id sequence and its
// transaction id counter are behind what the relay saw, so rows written on it after the
// promotion get ids at or below the cursor and transaction ids the old snapshot counts as
// finished — neither "after the cursor" nor "late commits". A relay that keeps its cursor
// (its leases survive a short outage: the new primary's lease rows still name it, same epoch)
// would skip them for as long as it runs. Every row written after the promotion must reach
// Kafka, and the outbox must drain.
//
// The standby is made to lag deterministically: it is stopped while the primary keeps
// writing and publishing (more rows than the sequence caches, 32), then the primary is killed
// and the standby started again and promoted.
func TestRelayFollowsAFailoverToAStandbyThatLagged(t *testing.T) {
	ctx := context.Background()
	pair, db := testdb.NewPair(t, false)
	brokers := kafkatest.Brokers(t, 4)
	topic := kafkatest.Topic("pgfailover")
	c := newConsumer(t, brokers, topic)
	// A lease long enough that the outage (a stop, a start and a promotion on a busy machine)
	// never lapses the fence: a relay that lost its leases would re-acquire them and restart
	// its cursor anyway, which hides nothing but tests less.
	rec := newRecorder()
	startRelay(t, newKafkaRelay(t, db, brokers, relay.Config{LeaseDuration: 40 * time.Second, PollInterval: 50 * time.Millisecond, Metrics: rec}))
	rec.waitFor(t, 30*time.Second, "shards owned", func(r *recorder) bool { return r.owned > 0 })

	before := writeEventsPrefix(t, db, topic, 40, 4, 2, "before-")
	c.waitDistinct(t, len(before), 60*time.Second)
	eventually(t, 30*time.Second, "empty outbox", func() bool { return outboxCount(t, db) == 0 })
	if err := pair.Standby.WaitReplayed(ctx, pair.Primary); err != nil {
		t.Fatal(err)
	}
	if err := pair.Standby.Halt(ctx); err != nil {
		t.Fatal(err)
	}
	// Written, committed, published and deleted on the primary only: the standby never sees them.
	lost := writeEventsPrefix(t, db, topic, 200, 4, 2, "lost-")
	c.waitDistinct(t, len(before)+len(lost), 60*time.Second)
	eventually(t, 30*time.Second, "empty outbox", func() bool { return outboxCount(t, db) == 0 })

	probe := func(db *testdb.DB, what string) {
		var snap string
		var last *int64
		if err := db.Pool.QueryRow(ctx, `SELECT pg_current_snapshot()::text, pg_sequence_last_value(pg_get_serial_sequence($1, 'id')::regclass)`, db.Table("outbox")).Scan(&snap, &last); err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: snapshot %s, last id %v", what, snap, *last)
	}
	probe(db, "old primary")
	if err := pair.Primary.Halt(ctx); err != nil {
		t.Fatal(err)
	}
	if err := pair.Standby.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	if err := pair.Standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	// The relay keeps the shared pool and meets its dead connections to the old primary; the
	// test's own probe and writes use a fresh pool, since one query on a stale connection fails
	// with "unexpected EOF" and the test's helpers do not retry.
	app := freshPool(t, db)
	probe(app, "new primary")
	after := writeEventsPrefix(t, app, topic, 40, 4, 2, "after-")
	got := c.waitDistinct(t, len(before)+len(lost)+len(after), 60*time.Second)
	checkDelivery(t, append(append(append([]written{}, before...), lost...), after...), got)
	eventually(t, 30*time.Second, "empty outbox", func() bool { return outboxCount(t, app) == 0 })
	rec.mu.Lock()
	owned := rec.owned
	rec.mu.Unlock()
	if owned == 0 {
		t.Fatal("the relay holds no shard after the failover")
	}
}

// freshPool opens a second pool on db's server and schema, closed when the test ends.
func freshPool(t *testing.T, db *testdb.DB) *testdb.DB {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = ""
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return &testdb.DB{Pool: pool, Schema: db.Schema, URL: db.URL}
}
