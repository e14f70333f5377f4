package relay_test

import (
	"context"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// TestRebalanceUnderFaultsKeepsKeyOrder: relays start and stop (gracefully, with short and
// long shutdown timeouts) every few hundred milliseconds, so shards keep moving between them
// with batches in flight, while every topic's produce requests randomly fail and keys spread
// over two topics. No row may be acknowledged while an earlier row of its key still waits,
// and everything arrives.
func TestRebalanceUnderFaultsKeepsKeyOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	violations := orderWatch(t, db)
	k := kafkatest.Fake(t, 2)
	brokers := k.Brokers()
	topics := []string{kafkatest.Topic("rb-a"), kafkatest.Topic("rb-b")}
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 13))
	var mu sync.Mutex
	chance := func(p float64) func(kmsg.Request) bool {
		return func(kmsg.Request) bool { mu.Lock(); defer mu.Unlock(); return rng.Float64() < p }
	}
	intn := func(n int) int { mu.Lock(); defer mu.Unlock(); return rng.IntN(n) }
	for _, topic := range topics {
		for _, e := range []*kerr.Error{kerr.NotLeaderForPartition, kerr.InvalidRecord, kerr.TopicAuthorizationFailed, kerr.RequestTimedOut} {
			k.Cluster.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: e, Count: -1, When: chance(0.04)})
		}
	}
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	var total int
	var wmu sync.Mutex
	seq := map[string]int{}
	write := func(n int) {
		wmu.Lock()
		defer wmu.Unlock()
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			for range n {
				key := "key-" + strconv.Itoa(intn(40))
				topic := topics[intn(len(topics))]
				m := outbox.SetPartitionKey(outbox.NewMessage([]byte(key+"/"+strconv.Itoa(seq[key]))), key)
				seq[key]++
				if err := w.WriteTx(ctx, tx, topic, m); err != nil {
					return err
				}
			}
			return nil
		}); err != nil {
			t.Error(err)
		}
		total += n
	}
	write(3000)
	var cs []*consumer
	for _, topic := range topics {
		cs = append(cs, newConsumer(t, brokers, topic))
	}
	mk := func(id string) *relay.Relay {
		return newKafkaRelayWith(t, db, relaykafka.Config{Brokers: brokers, DeliveryTimeout: time.Second, Opts: fastRetries},
			relay.Config{InstanceID: id, Shards: 16, BatchSize: 30, LeaseDuration: 800 * time.Millisecond, MaxAttempts: 1000,
				PollInterval: 50 * time.Millisecond, ShutdownTimeout: time.Duration(1+intn(300)) * time.Millisecond,
				RetryBackoff: 5 * time.Millisecond, MaxRetryBackoff: 50 * time.Millisecond})
	}
	stops := map[int]func(){}
	for i := 0; i < 20; i++ {
		id := intn(3)
		if s, ok := stops[id]; ok {
			s()
			delete(stops, id)
		} else {
			stops[id] = startRelay(t, mk("r"+strconv.Itoa(id)+"-"+strconv.Itoa(i)))
		}
		write(20)
		time.Sleep(time.Duration(100+intn(400)) * time.Millisecond)
	}
	if len(stops) == 0 {
		stops[0] = startRelay(t, mk("final"))
	}
	eventually(t, 2*time.Minute, "empty outbox", func() bool { return outboxCount(t, db) == 0 })
	eventually(t, time.Minute, "every event consumed", func() bool {
		n := 0
		for _, c := range cs {
			n += c.distinct()
		}
		return n == total
	})
	if v := violations(); len(v) > 0 {
		t.Fatalf("%d rows acknowledged while an earlier row of their key waited, e.g. %v", len(v), v[:min(len(v), 5)])
	}
}
