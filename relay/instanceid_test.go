package relay_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/relay"
)

// epochSum is the sum of every shard's epoch: it grows by one each time a shard changes hands.
func epochSum(t testing.TB, db *testdb.DB) int64 {
	t.Helper()
	var n int64
	if err := db.Pool.QueryRow(context.Background(), `SELECT coalesce(sum(epoch), 0) FROM `+db.Table("relay_lease")).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestDuplicateInstanceIDRefused: a second relay process started with an id a live relay
// already uses refuses to start with ErrInstanceIDInUse, and the first keeps its shards: no
// lease changes hands. Before, both ran and stole each other's shards at every renewal
// (hundreds of epoch bumps in seconds) and published duplicates.
func TestDuplicateInstanceIDRefused(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 1)
	cfg := relay.Config{InstanceID: "replica", LeaseDuration: time.Second}
	first := newKafkaRelay(t, db, brokers, cfg)
	startRelay(t, first)
	eventually(t, 10*time.Second, "the first relay holds every shard", func() bool {
		var n int
		_ = db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM `+db.Table("relay_lease")+` WHERE owner = 'replica' AND expires_at > now()`).Scan(&n)
		return n == relay.DefaultShards
	})
	before := epochSum(t, db)

	second := newKafkaRelay(t, db, brokers, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := second.Run(ctx)
	if !errors.Is(err, relay.ErrInstanceIDInUse) {
		t.Fatalf("second relay with the same id: Run = %v, want ErrInstanceIDInUse", err)
	}
	t.Logf("second relay: %v", err)
	time.Sleep(time.Second) // a few renewals of the first relay
	if after := epochSum(t, db); after != before {
		t.Fatalf("epochs moved from %d to %d: shards changed hands", before, after)
	}
	if err := first.Health(); err != nil {
		t.Fatalf("first relay unhealthy: %v", err)
	}
}

// TestInstanceIDTakenOverStopsTheOldRelay: when another process took the id over (it found
// this relay's heartbeat stalled, e.g. while the process was paused), this relay stops at its
// next heartbeat with ErrInstanceIDInUse instead of fighting over the shards.
func TestInstanceIDTakenOverStopsTheOldRelay(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 1)
	r := newKafkaRelay(t, db, brokers, relay.Config{InstanceID: "paused", LeaseDuration: time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- r.Run(ctx) }()
	eventually(t, 10*time.Second, "healthy", func() bool { return r.Health() == nil })
	// What a successor's join does to the row: a token of its own.
	if _, err := db.Pool.Exec(ctx, `UPDATE `+db.Table("relay_member")+` SET token = 'successor' WHERE id = 'paused'`); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errc:
		if !errors.Is(err, relay.ErrInstanceIDInUse) {
			t.Fatalf("Run = %v, want ErrInstanceIDInUse", err)
		}
	case <-ctx.Done():
		t.Fatal("the relay kept running after its id was taken over")
	}
	// It did not delete the successor's membership on the way out.
	var n int
	if err := db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM `+db.Table("relay_member")+` WHERE id = 'paused' AND token = 'successor'`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("successor's member row: %d rows, err %v", n, err)
	}
}

// TestRestartTakesOverACrashedRelaysID: a relay restarted with the id of a process that died
// without leaving (its member row and leases look live, its heartbeat no longer moves) takes
// the id and its shards over after waiting one and a half renewal intervals, and publishes.
func TestRestartTakesOverACrashedRelaysID(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 1)
	topic := kafkatest.Topic("takeover")
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("relay_lease")+` (shard, owner, epoch, expires_at)
		SELECT s, 'crashed', 1, now() + interval '1 hour' FROM generate_series(0, 63) s`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("relay_member")+` (id, expires_at, heartbeat_at, token)
		VALUES ('crashed', now() + interval '1 hour', now() - interval '1 second', 'dead-process')`); err != nil {
		t.Fatal(err)
	}
	want := writeEvents(t, db, topic, 40, 4, 10)
	c := newConsumer(t, brokers, topic)
	r := newKafkaRelay(t, db, brokers, relay.Config{InstanceID: "crashed", LeaseDuration: time.Second})
	startRelay(t, r)
	got := c.waitDistinct(t, len(want), 30*time.Second)
	checkDelivery(t, want, got)
}
