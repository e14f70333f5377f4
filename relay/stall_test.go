package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/relay"
)

// TestStalledClaimTimesOut: a claim stuck behind a lock (here an ACCESS EXCLUSIVE lock on the
// outbox, as a stuck migration would hold) is cut after Config.StatementTimeout, counted as a
// database failure and retried, instead of waiting silently for as long as the lock is held
// while the relay's renewals keep its shards; once the lock goes, the rows are delivered.
// Before, the claim had no deadline: no failure was seen during the stall.
func TestStalledClaimTimesOut(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 1)
	topic := kafkatest.Topic("stall")
	want := writeEvents(t, db, topic, 30, 3, 10)
	c := newConsumer(t, brokers, topic)

	lock, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lock.Rollback(ctx) }()
	if _, err := lock.Exec(ctx, `LOCK TABLE `+db.Table("outbox")+` IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	r := newKafkaRelay(t, db, brokers, relay.Config{Metrics: rec, StatementTimeout: 300 * time.Millisecond,
		RetryBackoff: 50 * time.Millisecond, MaxRetryBackoff: 200 * time.Millisecond})
	startRelay(t, r)
	rec.waitFor(t, 20*time.Second, "a database failure from the stalled claim", func(r *recorder) bool {
		return r.failed[relay.FailureDatabase] > 0
	})
	if err := r.Health(); err != nil {
		t.Fatalf("relay unhealthy during the stall (its renewals do not touch the outbox): %v", err)
	}
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	got := c.waitDistinct(t, len(want), 30*time.Second)
	checkDelivery(t, want, got)
}
