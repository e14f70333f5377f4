package relay_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// produceErrorResponse answers a produce request with code on every partition, before the
// broker writes anything.
func produceErrorResponse(req *kmsg.ProduceRequest, code int16) *kmsg.ProduceResponse {
	resp := req.ResponseKind().(*kmsg.ProduceResponse)
	resp.Version = req.Version
	for _, rt := range req.Topics {
		st := kmsg.NewProduceResponseTopic()
		st.Topic, st.TopicID = rt.Topic, rt.TopicID
		for _, rp := range rt.Partitions {
			sp := kmsg.NewProduceResponseTopicPartition()
			sp.Partition = rp.Partition
			sp.ErrorCode = code
			st.Partitions = append(st.Partitions, sp)
		}
		resp.Topics = append(resp.Topics, st)
	}
	return resp
}

// TestBrokerFaults: a fifth of the produce requests fail — retriable errors, non-retriable
// errors that reject a whole record batch, dropped connections, and timeouts reported after
// the broker already wrote the batch. Nothing may be lost, no key reordered, nothing parked.
func TestBrokerFaults(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	k := kafkatest.Fake(t, 3)
	brokers := k.Brokers()
	topic := kafkatest.Topic("faults")

	var mu sync.Mutex
	seed := rand.Uint64()
	t.Logf("fault seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 7))
	var requests, injected atomic.Int64
	kinds := map[string]int{}
	k.Cluster.ControlKey(int16(kmsg.Produce), func(r kmsg.Request) (kmsg.Response, error, bool) {
		k.Cluster.KeepControl()
		requests.Add(1)
		mu.Lock()
		defer mu.Unlock()
		if rng.Float64() >= 0.15 {
			return nil, nil, false // handled normally (or by the timeout fault below)
		}
		injected.Add(1)
		req := r.(*kmsg.ProduceRequest)
		switch n := rng.IntN(4); n {
		case 0:
			kinds["NOT_LEADER_FOR_PARTITION"]++
			return produceErrorResponse(req, kerr.NotLeaderForPartition.Code), nil, true
		case 1:
			kinds["REQUEST_TIMED_OUT (not written)"]++
			return produceErrorResponse(req, kerr.RequestTimedOut.Code), nil, true
		case 2:
			kinds["INVALID_RECORD (non-retriable)"]++
			return produceErrorResponse(req, kerr.InvalidRecord.Code), nil, true
		default:
			kinds["connection dropped"]++
			return nil, errors.New("injected: drop the connection"), true
		}
	})
	// The nastiest case for an idempotent producer: the broker writes the batch, then reports a
	// timeout, so the client retries something that already landed.
	var written atomic.Int64
	k.Cluster.Fault(kfake.Fault{
		Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.RequestTimedOut, Count: -1,
		When: func(kmsg.Request) bool {
			if rand.Float64() < 0.05 {
				written.Add(1)
				return true
			}
			return false
		},
	})

	// Few keys per batch row count: each batch carries several rows of every key, so any
	// reordering inside a batch or across retries would show.
	want := writeEvents(t, db, topic, 5000, 8, 50)
	c := newConsumer(t, brokers, topic)
	r := newKafkaRelayWith(t, db, relaykafka.Config{Brokers: brokers, Opts: fastRetries}, relay.Config{
		// Small batches: many produce requests, so the fault mix is well exercised.
		BatchSize: 25, MaxAttempts: 1000, // random non-retriable faults must never park a row
		RetryBackoff: 5 * time.Millisecond, MaxRetryBackoff: 100 * time.Millisecond,
	})
	stop := startRelay(t, r)
	got := c.waitDistinct(t, len(want), 2*time.Minute)
	eventually(t, time.Minute, "empty outbox", func() bool { return outboxCount(t, db) == 0 })
	stop()
	dups := checkDelivery(t, want, got)

	var parked int
	if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+db.Table("outbox_parked")).Scan(&parked); err != nil {
		t.Fatal(err)
	}
	if parked != 0 {
		t.Fatalf("%d rows parked by random broker faults", parked)
	}
	total := requests.Load()
	faults := injected.Load() + written.Load()
	mu.Lock()
	t.Logf("%d produce requests, %d faulted (%v, %d written-then-timed-out); %d duplicates", total, faults, kinds, written.Load(), dups)
	mu.Unlock()
	if total == 0 || float64(faults) < 0.10*float64(total) {
		t.Fatalf("only %d of %d produce requests faulted; the test needs at least 10%%", faults, total)
	}
}

// TestBrokerOutage: while every produce request is refused (here: the relay lost its
// cluster-level ACL, CLUSTER_AUTHORIZATION_FAILED, which the producer reports at once and the
// relay treats as transient, unlike a refusal of one topic), rows stay in the
// outbox and the relay backs off instead of hammering the broker; when the broker accepts
// again, everything is delivered in order and nothing was parked.
func TestBrokerOutage(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	k := kafkatest.Fake(t, 1)
	brokers := k.Brokers()
	topic := kafkatest.Topic("outage")
	c := newConsumer(t, brokers, topic)
	rec := newRecorder()
	r := newKafkaRelayWith(t, db, relaykafka.Config{Brokers: brokers, DeliveryTimeout: time.Second, Opts: fastRetries},
		relay.Config{Metrics: rec, RetryBackoff: 50 * time.Millisecond, MaxRetryBackoff: 800 * time.Millisecond})
	startRelay(t, r)
	first := writeEventsPrefix(t, db, topic, 20, 4, 20, "before-")
	c.waitDistinct(t, len(first), 30*time.Second)

	var down atomic.Bool
	down.Store(true)
	k.Cluster.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		k.Cluster.KeepControl()
		if !down.Load() {
			return nil, nil, false
		}
		return produceErrorResponse(req.(*kmsg.ProduceRequest), kerr.ClusterAuthorizationFailed.Code), nil, true
	})
	during := writeEventsPrefix(t, db, topic, 200, 8, 20, "during-")
	rec.waitFor(t, 30*time.Second, "the first failed batch", func(r *recorder) bool { return r.failCalls > 0 })
	rec.mu.Lock()
	calls0 := rec.failCalls
	rec.mu.Unlock()
	outage := 4 * time.Second
	time.Sleep(outage) // the outage lasts this long; we count what the relay does meanwhile
	rec.mu.Lock()
	calls := rec.failCalls - calls0
	rec.mu.Unlock()
	if n := outboxCount(t, db); n != len(during) {
		t.Fatalf("%d rows in the outbox during the outage, want all %d", n, len(during))
	}
	// The refusal comes back in about a millisecond: without backoff the relay retries well
	// over a thousand times in 4 s (measured with 1 ms backoffs). With 50 ms doubling up to
	// 800 ms it is about ten.
	t.Logf("%d failed publish calls during a %s outage", calls, outage)
	if calls > 30 {
		t.Fatalf("%d failed publish calls in %s: the relay does not back off", calls, outage)
	}
	down.Store(false)
	got := c.waitDistinct(t, len(first)+len(during), 60*time.Second)
	eventually(t, 30*time.Second, "empty outbox", func() bool { return outboxCount(t, db) == 0 })
	checkDelivery(t, append(first, during...), got)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if rec.parked != 0 || rec.failed[relay.FailureUndeliverable] != 0 || rec.failed[relay.FailureTransient] == 0 {
		t.Fatalf("failures %v, parked %d: an outage must count as transient and park nothing", rec.failed, rec.parked)
	}
}

// TestDeleteFailures: PostgreSQL refuses three deletes of acknowledged rows in every five, in a
// row (a trigger raising, as a lost connection or a failover would). A delete sent with a
// prefetched claim that fails is sent again with the next claim, and then alone; when that
// fails too, the refused rows stay in the outbox and must be claimed and published again (same
// event ids) before any later row of their key. In the end everything is delivered in per-key
// order and the outbox is empty.
func TestDeleteFailures(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	s := pgsql.Ident(db.Schema)
	for _, stmt := range []string{
		`CREATE SEQUENCE ` + s + `.delete_calls`,
		`CREATE FUNCTION ` + s + `.refuse_deletes() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF nextval('` + s + `.delete_calls') % 5 < 3 THEN RAISE EXCEPTION 'injected: delete refused'; END IF;
			RETURN NULL;
		END $$`,
		`CREATE TRIGGER refuse_deletes BEFORE DELETE ON ` + s + `.outbox FOR EACH STATEMENT EXECUTE FUNCTION ` + s + `.refuse_deletes()`,
	} {
		if _, err := db.Pool.Exec(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	k := kafkatest.Fake(t, 1)
	topic := kafkatest.Topic("delete-faults")
	want := writeEvents(t, db, topic, 2000, 8, 50)
	c := newConsumer(t, k.Brokers(), topic)
	rec := newRecorder()
	stop := startRelay(t, newKafkaRelay(t, db, k.Brokers(), relay.Config{Metrics: rec, BatchSize: 25,
		RetryBackoff: 5 * time.Millisecond, MaxRetryBackoff: 50 * time.Millisecond}))
	got := c.waitDistinct(t, len(want), time.Minute)
	eventually(t, time.Minute, "empty outbox", func() bool { return outboxCount(t, db) == 0 })
	stop()
	dups := checkDelivery(t, want, got)
	var calls int64
	if err := db.Pool.QueryRow(ctx, `SELECT last_value FROM `+s+`.delete_calls`).Scan(&calls); err != nil {
		t.Fatal(err)
	}
	rec.mu.Lock()
	failed := rec.failed[relay.FailureDatabase]
	rec.mu.Unlock()
	t.Logf("%d delete statements, %d database failures counted, %d duplicates", calls, failed, dups)
	if failed == 0 || dups == 0 {
		t.Fatalf("%d database failures and %d duplicates: the refused deletes were not exercised", failed, dups)
	}
}

// TestShutdownDeletesAcknowledgedRows: a relay stopped right after Kafka acknowledged its last
// batch deletes that batch before Run returns, although the delete normally waits for the next
// claim (here a second away): nothing it published is left to be published again.
func TestShutdownDeletesAcknowledgedRows(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	k := kafkatest.Fake(t, 1)
	topic := kafkatest.Topic("shutdown-delete")
	c := newConsumer(t, k.Brokers(), topic)
	rec := newRecorder()
	stop := startRelay(t, newKafkaRelay(t, db, k.Brokers(), relay.Config{Shards: 4, Metrics: rec,
		BusyPollInterval: time.Second, PollInterval: 2 * time.Second}))
	// Written once the relay holds its shards and sleeps: the commit wakes it, it publishes
	// the batch, and its next claim (which would carry the delete) is a second away.
	rec.waitFor(t, 30*time.Second, "all shards owned", func(r *recorder) bool { return r.owned == 4 })
	eventually(t, 30*time.Second, "relay asleep", func() bool {
		var asleep bool
		if err := db.Pool.QueryRow(context.Background(), `SELECT count(*) > 0 FROM `+db.Table("relay_member")+` WHERE asleep_until > now()`).Scan(&asleep); err != nil {
			t.Fatal(err)
		}
		return asleep
	})
	want := writeEvents(t, db, topic, 50, 5, 50)
	checkDelivery(t, want, c.waitDistinct(t, len(want), 30*time.Second))
	stop()
	if n := outboxCount(t, db); n != 0 {
		t.Fatalf("%d published rows left in the outbox after Run returned", n)
	}
}
