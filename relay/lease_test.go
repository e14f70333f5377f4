package relay_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// TestLostLeaseStopsPublishing: when another owner takes the shards (here by force, in the
// table), the relay notices at its next renewal and publishes nothing of them; it resumes
// only after it acquired them again, under a new epoch.
func TestLostLeaseStopsPublishing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 1)
	topic := kafkatest.Topic("stolen")
	rec := newRecorder()
	c := newConsumer(t, brokers, topic)
	cfg := relay.Config{Shards: 8, LeaseDuration: 2 * time.Second, PollInterval: 50 * time.Millisecond, Metrics: rec}
	startRelay(t, newKafkaRelay(t, db, brokers, cfg))
	rec.waitFor(t, 30*time.Second, "all shards owned", func(r *recorder) bool { return r.owned == 8 })
	first := writeEvents(t, db, topic, 10, 3, 10)
	c.waitDistinct(t, len(first), 30*time.Second)

	before := readLeases(t, db)
	if _, err := db.Pool.Exec(ctx, `UPDATE `+db.Table("relay_lease")+` SET owner = 'thief', epoch = epoch + 1, expires_at = now() + interval '1 hour'`); err != nil {
		t.Fatal(err)
	}
	rec.waitFor(t, 30*time.Second, "the relay to notice the lost leases", func(r *recorder) bool { return r.owned == 0 })
	stolen := writeEventsPrefix(t, db, topic, 10, 3, 10, "stolen-")
	// Nothing may be published while the thief holds the shards: 20 poll intervals of silence.
	time.Sleep(20 * cfg.PollInterval)
	if n := c.distinct(); n != len(first) {
		t.Fatalf("%d events published while another owner held every shard", n-len(first))
	}

	if _, err := db.Pool.Exec(ctx, `UPDATE `+db.Table("relay_lease")+` SET owner = '', expires_at = 'epoch'`); err != nil {
		t.Fatal(err)
	}
	rec.waitFor(t, 30*time.Second, "the relay to re-acquire", func(r *recorder) bool { return r.owned == 8 })
	got := c.waitDistinct(t, len(first)+len(stolen), 30*time.Second)
	checkDelivery(t, append(first, stolen...), got)
	after := readLeases(t, db)
	for i := range after {
		if after[i].Epoch < before[i].Epoch+2 {
			t.Fatalf("shard %d: epoch %d after the theft and re-acquisition, was %d", i, after[i].Epoch, before[i].Epoch)
		}
	}
}

// TestFenceStopsPublishingWhenRenewalsStall: the lease table is locked, so renewals hang while
// claims still work. The relay must stop publishing once its last renewal is older than the
// lease minus the margin — before the lease could expire in the database and another relay
// take over — and resume when renewals succeed again.
func TestFenceStopsPublishingWhenRenewalsStall(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 1)
	topic := kafkatest.Topic("fence")
	rec := newRecorder()
	c := newConsumer(t, brokers, topic)
	cfg := relay.Config{Shards: 4, LeaseDuration: time.Second, PollInterval: 50 * time.Millisecond, Metrics: rec}
	r := newKafkaRelay(t, db, brokers, cfg)
	startRelay(t, r)
	rec.waitFor(t, 30*time.Second, "all shards owned", func(r *recorder) bool { return r.owned == 4 })
	first := writeEvents(t, db, topic, 5, 2, 5)
	c.waitDistinct(t, len(first), 30*time.Second)

	lock, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lock.Exec(ctx, `LOCK TABLE `+db.Table("relay_lease")+` IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	locked := time.Now()
	rec.waitFor(t, 30*time.Second, "the fence to lapse", func(r *recorder) bool { return r.owned == 0 })
	if waited := time.Since(locked); waited > cfg.LeaseDuration+time.Second {
		t.Logf("fence lapsed %s after the lock (lease %s): slow machine?", waited, cfg.LeaseDuration)
	}
	// Health reports stale renewals once they are older than the lease.
	eventually(t, 30*time.Second, "Health() to report the stale renewals", func() bool {
		err := r.Health()
		return err != nil && strings.Contains(err.Error(), "renewal")
	})
	fenced := writeEventsPrefix(t, db, topic, 5, 2, 5, "fenced-")
	time.Sleep(20 * cfg.PollInterval) // silence expected: claims work, publishing must not
	if n := c.distinct(); n != len(first) {
		t.Fatalf("%d events published after the fence lapsed", n-len(first))
	}
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	rec.waitFor(t, 30*time.Second, "shards back", func(r *recorder) bool { return r.owned == 4 })
	got := c.waitDistinct(t, len(first)+len(fenced), 30*time.Second)
	checkDelivery(t, append(first, fenced...), got)
	eventually(t, 30*time.Second, "Health() ok again", func() bool { return r.Health() == nil })
}

// TestShutdownReleasesLeases: Run returns nil on cancellation, frees every lease and removes
// its membership row, so another relay starts publishing at once instead of after expiry.
func TestShutdownReleasesLeases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 1)
	rec := newRecorder()
	r := newKafkaRelay(t, db, brokers, relay.Config{Shards: 4, InstanceID: "first", Metrics: rec})
	if err := r.Health(); err == nil {
		t.Fatal("Health() = nil before Run")
	}
	stop := startRelay(t, r)
	rec.waitFor(t, 30*time.Second, "all shards owned", func(r *recorder) bool { return r.owned == 4 })
	if err := r.Health(); err != nil {
		t.Fatalf("Health() = %v while running", err)
	}
	stop()
	if o := liveOwners(readLeases(t, db)); len(o) != 0 {
		t.Fatalf("leases held after shutdown: %v", o)
	}
	var members int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Table("relay_member")).Scan(&members); err != nil {
		t.Fatal(err)
	}
	if members != 0 {
		t.Fatalf("%d member rows left after shutdown", members)
	}
	// A second relay with the default lease (8s) gets the shards well before it would expire.
	rec2 := newRecorder()
	start := time.Now()
	startRelay(t, newKafkaRelay(t, db, brokers, relay.Config{Shards: 4, InstanceID: "second", Metrics: rec2}))
	rec2.waitFor(t, 30*time.Second, "second relay owns the shards", func(r *recorder) bool { return r.owned == 4 })
	t.Logf("second relay took over %s after the first stopped", time.Since(start).Round(time.Millisecond))
}

// TestShardCountMustAgree: a relay configured with another shard count than the lease table
// refuses to start and says what to do; Reshard is refused while a relay runs and works once
// none does.
func TestShardCountMustAgree(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 1)
	rec := newRecorder()
	stop := startRelay(t, newKafkaRelay(t, db, brokers, relay.Config{Shards: 16, Metrics: rec}))
	rec.waitFor(t, 30*time.Second, "shards owned", func(r *recorder) bool { return r.owned == 16 })

	other := newKafkaRelay(t, db, brokers, relay.Config{Shards: 32})
	err := other.Run(ctx)
	if !errors.Is(err, relay.ErrShardCountMismatch) || !strings.Contains(err.Error(), "--shards 16") {
		t.Fatalf("Run with 32 shards against a 16-shard table: %v", err)
	}
	err = relay.Reshard(ctx, db.Pool, relay.ReshardOptions{Schema: db.Schema, Shards: 32})
	if err == nil || !strings.Contains(err.Error(), "running") {
		t.Fatalf("Reshard while a relay runs: %v", err)
	}
	if n := len(readLeases(t, db)); n != 16 {
		t.Fatalf("refused reshard changed the table to %d shards", n)
	}
	stop()
	if err := relay.Reshard(ctx, db.Pool, relay.ReshardOptions{Schema: db.Schema, Shards: 32}); err != nil {
		t.Fatal(err)
	}
	if n := len(readLeases(t, db)); n != 32 {
		t.Fatalf("after reshard: %d shards", n)
	}
	rec2 := newRecorder()
	startRelay(t, newKafkaRelay(t, db, brokers, relay.Config{Shards: 32, Metrics: rec2}))
	rec2.waitFor(t, 30*time.Second, "32 shards owned", func(r *recorder) bool { return r.owned == 32 })
	if err := relay.Reshard(ctx, db.Pool, relay.ReshardOptions{Schema: "Bad", Shards: 0}); err == nil ||
		!strings.Contains(err.Error(), "invalid schema name") || !strings.Contains(err.Error(), "shard count 0") {
		t.Fatalf("Reshard with bad options: %v", err)
	}
}

// TestNotMigrated: Run on a schema without the tables fails with a clear instruction.
func TestNotMigrated(t *testing.T) {
	t.Parallel()
	db := testdb.NewEmpty(t)
	r := newKafkaRelay(t, db, []string{"127.0.0.1:1"}, relay.Config{})
	err := r.Run(context.Background())
	if !errors.Is(err, relay.ErrNotMigrated) || !strings.Contains(err.Error(), "onceflow migrate up --schema "+db.Schema) {
		t.Fatalf("Run on an empty schema: %v", err)
	}
	// A schema that lacks only the newest step is refused too, naming that step: checking for a
	// few tables would have let it through.
	ctx := context.Background()
	if _, err := migrations.Up(ctx, db.Pool, migrations.Options{Schema: db.Schema}); err != nil {
		t.Fatal(err)
	}
	all := migrations.All()
	last := all[len(all)-1]
	if _, err := db.Pool.Exec(ctx, `DELETE FROM `+db.Schema+`.schema_migration WHERE version = $1`, last.Version); err != nil {
		t.Fatal(err)
	}
	err = newKafkaRelay(t, db, []string{"127.0.0.1:1"}, relay.Config{}).Run(ctx)
	if !errors.Is(err, relay.ErrNotMigrated) || !strings.Contains(err.Error(), last.Name) {
		t.Fatalf("Run on a schema without step %d (%s): %v", last.Version, last.Name, err)
	}
}

// TestDatabaseConnectionLoss: the relay's connections (pool and listener) are terminated
// again and again while a backlog drains; it reconnects and delivers everything, in order.
func TestDatabaseConnectionLoss(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 2)
	topic := kafkatest.Topic("pgloss")
	app := "relay-" + db.Schema
	pcfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	pcfg.ConnConfig.RuntimeParams["application_name"] = app
	pcfg.ConnConfig.RuntimeParams["search_path"] = db.Schema
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	want := writeEvents(t, db, topic, 6000, 20, 100)
	c := newConsumer(t, brokers, topic)
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: brokers})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sink.Close() }()
	rec := newRecorder()
	r, err := relay.New(relay.Config{Pool: pool, Sink: sink, Schema: db.Schema, BatchSize: 20, Metrics: rec, Logger: testLogger(t),
		LeaseDuration: 2 * time.Second, RetryBackoff: 10 * time.Millisecond, MaxRetryBackoff: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	stop := startRelay(t, r)
	terminated := 0
	for i := 0; i < 40 && c.distinct() < len(want); i++ {
		time.Sleep(50 * time.Millisecond) // let it make some progress between cuts
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1`, app).Scan(&n); err != nil {
			t.Fatal(err)
		}
		terminated += n
	}
	got := c.waitDistinct(t, len(want), 2*time.Minute)
	eventually(t, time.Minute, "empty outbox", func() bool { return outboxCount(t, db) == 0 })
	stop()
	checkDelivery(t, want, got)
	rec.mu.Lock()
	dbErrs := rec.failed[relay.FailureDatabase]
	rec.mu.Unlock()
	t.Logf("terminated %d backends; %d database errors seen and survived", terminated, dbErrs)
	if terminated == 0 {
		t.Fatal("no connection was terminated; the test did not exercise anything")
	}
}
