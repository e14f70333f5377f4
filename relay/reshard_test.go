package relay_test

import (
	"context"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/relay"
)

// TestReshardUnderAPausedRelay: the documented way to change the shard count is to stop every
// relay "or wait until their leases expire". A relay that is only paused (SIGSTOP here; a long
// GC or VM pause, a network partition from the database) has expired leases too, so Reshard
// goes ahead; when that relay resumes it must notice that the lease table no longer has its
// shard count and stop with ErrShardCountMismatch, not take shards of the new table with its
// old count (an index out of range panic for a shard beyond its count, keys mapped to the
// wrong shards otherwise).
func TestReshardUnderAPausedRelay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	brokers := kafkatest.Fake(t, 1).Brokers()
	topic := kafkatest.Topic("reshard")
	bin := buildOnceflow(t)
	const lease = time.Second

	old := startChild(t, bin, db, brokers, "--id", "old", "--shards", "4", "--lease-duration", lease.String())
	eventually(t, 60*time.Second, "the old relay to own its 4 shards", func() bool { return liveOwners(readLeases(t, db))["old"] == 4 })
	if err := old.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = old.cmd.Process.Signal(syscall.SIGCONT) }()
	eventually(t, 30*time.Second, "the paused relay's leases and heartbeat to expire", func() bool {
		var live int
		if err := db.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+db.Table("relay_lease")+` WHERE expires_at > now()) + (SELECT count(*) FROM `+db.Table("relay_member")+` WHERE expires_at > now())`).Scan(&live); err != nil {
			t.Fatal(err)
		}
		return live == 0
	})
	if err := relay.Reshard(ctx, db.Pool, relay.ReshardOptions{Schema: db.Schema, Shards: 8}); err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	startRelay(t, newKafkaRelay(t, db, brokers, relay.Config{InstanceID: "new", Shards: 8, LeaseDuration: lease, Metrics: rec}))
	rec.waitFor(t, 30*time.Second, "the new relay to own the 8 shards", func(r *recorder) bool { return r.owned == 8 })
	want := writeEvents(t, db, topic, 200, 20, 20)
	c := newConsumer(t, brokers, topic)

	if err := old.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	select {
	case <-old.done:
	case <-time.After(60 * time.Second):
		t.Fatalf("the resumed relay with the old shard count is still running:\n%s", tail(old.out.String(), 30))
	}
	out := old.out.String()
	if strings.Contains(out, "panic") || !strings.Contains(out, "has 8 shards") || old.err == nil {
		t.Fatalf("resumed relay with 4 shards against an 8-shard table: exit %v, want a clear shard count error:\n%s", old.err, tail(out, 30))
	}
	got := c.waitDistinct(t, len(want), 60*time.Second)
	checkDelivery(t, want, got)
	if o := liveOwners(readLeases(t, db)); o["old"] != 0 {
		t.Fatalf("the stopped relay still holds leases: %v", o)
	}
}
