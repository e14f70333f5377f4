package relay_test

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

type leaseRow struct {
	Shard      int
	Owner      string
	Epoch      int64
	ExpiresAt  time.Time
	AcquiredAt *time.Time
	Live       bool
}

func readLeases(t testing.TB, db *testdb.DB) []leaseRow {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), `SELECT shard, owner, epoch, expires_at, acquired_at, expires_at > now() FROM `+db.Table("relay_lease")+` ORDER BY shard`)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[leaseRow])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// liveOwners counts the live shards per owner.
func liveOwners(ls []leaseRow) map[string]int {
	m := map[string]int{}
	for _, l := range ls {
		if l.Owner != "" && l.Live {
			m[l.Owner]++
		}
	}
	return m
}

// backgroundWriter keeps writing events, one key at a time in order (so per-key write order
// is well defined), until stopped; it returns everything it wrote.
func backgroundWriter(t testing.TB, db *testdb.DB, topic string, keys int) (stop func() []written) {
	t.Helper()
	// Transactions run to completion on a context that is never cancelled: cancelling one
	// during COMMIT could leave it committed while the writer believes it failed.
	ctx := context.Background()
	var stopping atomic.Bool
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var out []written
	seq := map[string]int{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; !stopping.Load(); i++ {
			var batch []*message.Message
			var ws []written
			for j := range 20 {
				key := "bg-" + strconv.Itoa((i*20+j)%keys)
				s := seq[key]
				seq[key]++
				m := outbox.SetPartitionKey(outbox.NewMessage([]byte(key+"/"+strconv.Itoa(s))), key)
				batch = append(batch, m)
				ws = append(ws, written{EventID: m.UUID, Key: key, Seq: s})
			}
			if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return w.WriteTx(ctx, tx, topic, batch...) }); err != nil {
				t.Errorf("background writer: %v", err)
				return
			}
			mu.Lock()
			out = append(out, ws...)
			mu.Unlock()
			time.Sleep(2 * time.Millisecond) // pace, not synchronisation
		}
	}()
	return func() []written {
		stopping.Store(true)
		<-done
		mu.Lock()
		defer mu.Unlock()
		return out
	}
}

// TestThreeRelaysOneKilled: three `onceflow relay` processes share the outbox through shard
// leases; one is SIGKILLed mid-drain. Its shards must be taken over, not before its leases
// expired in the database and within the failover bound; everything is delivered, in order
// per key; the survivors exit 0 on SIGTERM and leave every lease free.
func TestThreeRelaysOneKilled(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	brokers := kafkatest.Fake(t, 3).Brokers()
	topic := kafkatest.Topic("three")
	bin := buildOnceflow(t)
	const lease = 2 * time.Second
	bound := relay.Config{LeaseDuration: lease}.FailoverBound()

	want := writeEvents(t, db, topic, 6000, 50, 100)
	// The background writer uses its own topic name so its events are checked separately.
	bgTopic := kafkatest.Topic("three-bg")
	stopWriter := backgroundWriter(t, db, bgTopic, 30)
	c := newConsumer(t, brokers, topic)
	cbg := newConsumer(t, brokers, bgTopic)
	flags := func(id string) []string {
		return []string{"--id", id, "--lease-duration", lease.String(), "--batch-size", "20", "--shards", "16"}
	}
	r1 := startChild(t, bin, db, brokers, flags("relay-1")...)
	r2 := startChild(t, bin, db, brokers, flags("relay-2")...)
	r3 := startChild(t, bin, db, brokers, flags("relay-3")...)

	eventually(t, 60*time.Second, "the three relays to share the shards", func() bool {
		o := liveOwners(readLeases(t, db))
		return o["relay-1"] > 0 && o["relay-2"] > 0 && o["relay-3"] > 0 && o["relay-1"]+o["relay-2"]+o["relay-3"] == 16
	})
	r2.kill()
	var killedAt time.Time
	if err := db.Pool.QueryRow(ctx, "SELECT now()").Scan(&killedAt); err != nil {
		t.Fatal(err)
	}
	orphans := map[int]leaseRow{}
	for _, l := range readLeases(t, db) {
		if l.Owner == "relay-2" {
			orphans[l.Shard] = l
		}
	}
	if left := outboxCount(t, db); left == 0 {
		t.Fatalf("the backlog drained before the kill; the test needs a relay killed mid-drain")
	}
	eventually(t, 60*time.Second, "the survivors to take over relay-2's shards", func() bool {
		o := liveOwners(readLeases(t, db))
		return o["relay-2"] == 0 && o["relay-1"]+o["relay-3"] == 16
	})
	var takeover time.Duration
	for _, l := range readLeases(t, db) {
		old, ok := orphans[l.Shard]
		if !ok {
			continue
		}
		if l.Epoch <= old.Epoch || l.AcquiredAt == nil {
			t.Fatalf("shard %d: epoch %d after takeover, was %d: the fencing token must move on", l.Shard, l.Epoch, old.Epoch)
		}
		if l.AcquiredAt.Before(old.ExpiresAt) {
			t.Fatalf("shard %d taken at %s, before relay-2's lease expired at %s", l.Shard, l.AcquiredAt, old.ExpiresAt)
		}
		takeover = max(takeover, l.AcquiredAt.Sub(killedAt))
	}
	t.Logf("relay-2 held %d shards; taken over %s after the kill (bound %s)", len(orphans), takeover.Round(time.Millisecond), bound)
	// The bound is a property of the protocol; the slack only absorbs a loaded test machine
	// delaying the survivors' renewal timers.
	if takeover > bound+2*time.Second {
		t.Fatalf("takeover took %s, over the failover bound %s", takeover, bound)
	}

	bgWant := stopWriter()
	got := c.waitDistinct(t, len(want), 2*time.Minute)
	bgGot := cbg.waitDistinct(t, len(bgWant), 2*time.Minute)
	eventually(t, time.Minute, "empty outbox", func() bool { return outboxCount(t, db) == 0 })
	for _, r := range []*child{r1, r3} {
		if err := r.stop(30 * time.Second); err != nil {
			t.Fatalf("relay after SIGTERM: %v (want exit 0)", err)
		}
	}
	checkDelivery(t, want, got)
	checkDelivery(t, bgWant, bgGot)
	if o := liveOwners(readLeases(t, db)); len(o) != 0 {
		t.Fatalf("leases still held after every relay stopped: %v", o)
	}
}
