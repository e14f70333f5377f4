package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/relay"
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
	// Topic A refuses every produce request (a missing ACL: the relay treats it as transient);
	// topic B, in the same produce requests, works.
	refuseA := k.Cluster.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topicA, Err: kerr.TopicAuthorizationFailed, Count: -1})

	first := writeOne(t, db, topicA, "K", []byte("k/0"))
	second := writeOne(t, db, topicB, "K", []byte("k/1"))
	third := writeOne(t, db, topicA, "K", []byte("k/2"))
	other := writeOne(t, db, topicB, "L", []byte("l/0"))
	ca, cb := newConsumer(t, brokers, topicA), newConsumer(t, brokers, topicB)
	rec := newRecorder()
	startRelay(t, newKafkaRelayWith(t, db, relay.KafkaConfig{Brokers: brokers, Opts: fastRetries},
		relay.Config{Metrics: rec, RetryBackoff: 20 * time.Millisecond, MaxRetryBackoff: 200 * time.Millisecond}))

	// Two failed publish calls: the first batch, with its deletes, is over.
	rec.waitFor(t, 30*time.Second, "two failed publish calls", func(r *recorder) bool { return r.failed[relay.FailTransient] >= 2 })
	var left int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE event_id = ANY($1::uuid[])`, []string{second.UUID, third.UUID}).Scan(&left); err != nil {
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
