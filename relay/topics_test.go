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
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// TestKeyOrderAcrossTopics: the events of one key may go to several topics (an aggregate
// emitting to "orders" and "payments", an inbox handler routing its output). A key maps to a
// different partition in each topic, and franz-go keeps a failure gapless per partition only,
// so while the key's row for topic A is refused, its later row for topic B must wait in the
// outbox instead of being acknowledged by the same produce flush.
func TestKeyOrderAcrossTopics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	k := kafkatest.Fake(t, 1)
	brokers := k.Brokers()
	topicA, topicB := kafkatest.Topic("across-a"), kafkatest.Topic("across-b")
	// Topic A refuses every produce request (a missing ACL: the topic is refused as a whole,
	// relay.TopicError); topic B, in the same produce requests, works.
	refuseA := k.Cluster.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topicA, Err: kerr.TopicAuthorizationFailed, Count: -1})

	first := writeOne(t, db, topicA, "K", []byte("k/0"))
	second := writeOne(t, db, topicB, "K", []byte("k/1"))
	third := writeOne(t, db, topicA, "K", []byte("k/2"))
	other := writeOne(t, db, topicB, "L", []byte("l/0"))
	ca, cb := newConsumer(t, brokers, topicA), newConsumer(t, brokers, topicB)
	rec := newRecorder()
	startRelay(t, newKafkaRelayWith(t, db, relaykafka.Config{Brokers: brokers, Opts: fastRetries},
		// Refusals count toward parking; none may park here (parking breaks order by design).
		relay.Config{Metrics: rec, RetryBackoff: 20 * time.Millisecond, MaxRetryBackoff: 200 * time.Millisecond, MaxAttempts: 1000}))

	// Two refusals: the first batch, with its deletes, is over.
	rec.waitFor(t, 30*time.Second, "two refusals", func(r *recorder) bool { return r.failed[relay.FailureUndeliverable] >= 2 })
	var left int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Table("outbox")+` WHERE event_id = ANY($1::uuid[])`, []string{second.UUID, third.UUID}).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 2 {
		t.Fatalf("key K's row for topic %s was acknowledged while its earlier row for topic %s was refused: per-key order broken", topicB, topicA)
	}
	if got := cb.waitDistinct(t, 1, 30*time.Second); len(got) != 1 || got[0].EventID != other.UUID {
		t.Fatalf("topic B delivered %+v while topic A was refused; want only key L's row", got)
	}

	refuseA.Remove()
	ca.waitDistinct(t, 2, 30*time.Second)
	got := cb.waitDistinct(t, 2, 30*time.Second)
	if ids := keyOrder(got, "K"); len(ids) != 1 || ids[0] != second.UUID {
		t.Fatalf("topic B, key K: %v", ids)
	}
	if ids := keyOrder(ca.snapshot(), "K"); len(ids) != 2 || ids[0] != first.UUID || ids[1] != third.UUID {
		t.Fatalf("topic A, key K: %v", ids)
	}
	eventually(t, 30*time.Second, "empty outbox", func() bool { return outboxCount(t, db) == 0 })
}

// orderWatch installs a statement trigger on the outbox that records every row deleted while
// an earlier row of its key is still in the outbox: with no parking and no database faults,
// such a row was acknowledged by Kafka before an earlier event of its key, whatever topics
// the two went to. It returns a function that lists the violations.
func orderWatch(t testing.TB, db *testdb.DB) func() []string {
	t.Helper()
	ctx := context.Background()
	s := pgsql.Ident(db.Schema)
	for _, stmt := range []string{
		`CREATE TABLE ` + s + `.order_violation (deleted bigint, earlier bigint, key text)`,
		`CREATE FUNCTION ` + s + `.order_check() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			INSERT INTO ` + s + `.order_violation
			SELECT g.id, min(o.id), g.partition_key FROM gone g JOIN ` + s + `.outbox o ON o.partition_key = g.partition_key AND o.id < g.id
			WHERE g.partition_key <> '' GROUP BY g.id, g.partition_key;
			RETURN NULL;
		END $$`,
		`CREATE TRIGGER order_check AFTER DELETE ON ` + s + `.outbox REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION ` + s + `.order_check()`,
	} {
		if _, err := db.Pool.Exec(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	return func() []string {
		rows, err := db.Pool.Query(ctx, `SELECT format('row %s of key %s deleted while row %s was waiting', deleted, key, earlier) FROM `+s+`.order_violation ORDER BY deleted`)
		if err != nil {
			t.Fatal(err)
		}
		v, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
}

// TestKeyOrderAcrossTopicsUnderFaults: keys spread their events over three topics while each
// topic's produce requests randomly fail (retriable, non-retriable, authorisation): no row may
// be acknowledged while an earlier row of its key still waits, and everything arrives.
func TestKeyOrderAcrossTopicsUnderFaults(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	violations := orderWatch(t, db)
	k := kafkatest.Fake(t, 2)
	brokers := k.Brokers()
	topics := []string{kafkatest.Topic("tf-a"), kafkatest.Topic("tf-b"), kafkatest.Topic("tf-c")}
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 11))
	var mu sync.Mutex
	chance := func(p float64) func(kmsg.Request) bool {
		return func(kmsg.Request) bool { mu.Lock(); defer mu.Unlock(); return rng.Float64() < p }
	}
	var handles []*kfake.FaultHandle
	for _, topic := range topics {
		for _, e := range []*kerr.Error{kerr.NotLeaderForPartition, kerr.InvalidRecord, kerr.TopicAuthorizationFailed} {
			handles = append(handles, k.Cluster.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: e, Count: -1, When: chance(0.07)}))
		}
	}

	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	seq := map[string]int{}
	for i := 0; i < 1500; i += 10 {
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			for j := range 10 {
				key := "key-" + strconv.Itoa((i+j)%12)
				m := outbox.SetPartitionKey(outbox.NewMessage([]byte(key+"/"+strconv.Itoa(seq[key]))), key)
				seq[key]++
				want = append(want, m.UUID)
				if err := w.WriteTx(ctx, tx, topics[rng.IntN(len(topics))], m); err != nil {
					return err
				}
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	var cs []*consumer
	for _, topic := range topics {
		cs = append(cs, newConsumer(t, brokers, topic))
	}
	startRelay(t, newKafkaRelayWith(t, db, relaykafka.Config{Brokers: brokers, DeliveryTimeout: time.Second, Opts: fastRetries},
		relay.Config{BatchSize: 40, MaxAttempts: 1000, RetryBackoff: 5 * time.Millisecond, MaxRetryBackoff: 50 * time.Millisecond}))
	eventually(t, 2*time.Minute, "empty outbox", func() bool { return outboxCount(t, db) == 0 })
	faults := 0
	for _, h := range handles {
		faults += h.Hits()
		h.Remove()
	}
	eventually(t, time.Minute, "every event consumed", func() bool {
		n := 0
		for _, c := range cs {
			n += c.distinct()
		}
		return n == len(want)
	})
	t.Logf("%d injected produce faults", faults)
	if faults == 0 {
		t.Fatal("no fault was injected")
	}
	if v := violations(); len(v) > 0 {
		t.Fatalf("%d rows acknowledged while an earlier row of their key waited, e.g. %v", len(v), v[:min(len(v), 5)])
	}
}
