package relay_test

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
)

// TestCrashSafetySIGKILL runs `onceflow relay` as a child process and SIGKILLs it at random
// moments, at least 20 times while a 20,000-event backlog over 50 keys drains, restarting it
// each time; then it lets one run finish. Every event must reach Kafka, a duplicate must carry
// its original id, and within each key the first occurrences must be in write order.
func TestCrashSafetySIGKILL(t *testing.T) {
	t.Parallel()
	const total, keys, minKills = 20000, 50, 20
	db := testdb.New(t)
	brokers := kafkatest.Fake(t, 1).Brokers()
	topic := kafkatest.Topic("crash")
	bin := buildOnceflow(t)
	want := writeEvents(t, db, topic, total, keys, 100)
	c := newConsumer(t, brokers, topic)
	// Small batches make the drain take many round trips, so random kills land in every phase:
	// start-up, claim, produce, delete. The same --id lets each restart take its leases back at
	// once, as a restarted pod would.
	flags := []string{"--batch-size", "25", "--id", "crash-relay", "--poll-interval", "100ms"}

	kills := 0
	maxDelay := 400 * time.Millisecond
	left := outboxCount(t, db)
	for kills < minKills {
		if left == 0 {
			t.Fatalf("the backlog drained after only %d kills; the test needs %d kills during the drain", kills, minKills)
		}
		ch := startChild(t, bin, db, brokers, flags...)
		// A random moment, not a synchronisation: the kill may hit start-up, a claim, a produce
		// request or a delete.
		time.Sleep(time.Duration(rand.Int64N(int64(maxDelay))))
		if done, err := ch.exited(); done {
			t.Fatalf("relay exited on its own before the kill: %v\n%s", err, tail(ch.out.String(), 40))
		}
		ch.kill()
		kills++
		now := outboxCount(t, db)
		t.Logf("kill %d after up to %s: %d rows left, %d distinct events in Kafka", kills, maxDelay, now, c.distinct())
		// Keep rows for the kills still to come on fast machines: if this run drained more
		// than its share, aim the next ones earlier.
		if share := left / (minKills - kills + 1); left-now > share && maxDelay > 40*time.Millisecond {
			maxDelay /= 2
		}
		left = now
	}
	final := startChild(t, bin, db, brokers, flags...)
	got := c.waitDistinct(t, total, 3*time.Minute)
	eventually(t, time.Minute, "empty outbox", func() bool { return outboxCount(t, db) == 0 })
	if err := final.stop(30 * time.Second); err != nil {
		t.Fatalf("relay after SIGTERM: %v (want exit 0)", err)
	}
	dups := checkDelivery(t, want, got)
	var parked int
	if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+db.Table("outbox_parked")).Scan(&parked); err != nil {
		t.Fatal(err)
	}
	if parked != 0 {
		t.Fatalf("%d rows parked; crashes must never park anything", parked)
	}
	t.Logf("%d kills, %d events, %d duplicates (same ids), per-key order kept", kills, total, dups)
}
