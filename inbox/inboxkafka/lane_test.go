package inboxkafka_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
)

// produceKeys sends one message per entry of keys, in that order, to partition 0, each
// numbered within its key (next: the numbers used so far, updated), with the Kafka key set and no partition_key metadata (a producer
// other than the relay): the batched consumer's lane key is then the Kafka key.
func (f *bfix) produceKeys(next map[string]int, keys ...string) []produced {
	f.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(f.brokers...), kgo.DefaultProduceTopic(f.topic), kgo.AllowAutoTopicCreation(),
		kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		f.t.Fatal(err)
	}
	defer cl.Close()
	out := make([]produced, len(keys))
	recs := make([]*kgo.Record, len(keys))
	for i, key := range keys {
		next[key]++
		out[i] = produced{uuid: outbox.NewUUID(), key: key, seq: next[key]}
		recs[i] = &kgo.Record{Key: []byte(key), Value: []byte(`{}`), Headers: []kgo.RecordHeader{
			{Key: kafka.UUIDHeaderKey, Value: []byte(out[i].uuid)},
			{Key: "seq", Value: []byte(strconv.Itoa(out[i].seq))},
			{Key: "k", Value: []byte(key)},
		}}
	}
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		f.t.Fatal(err)
	}
	return out
}

// appliedOrder is the applied effects as "key+seq", in commit order.
func (f *bfix) appliedOrder() []string {
	f.t.Helper()
	rows, err := f.db.Pool.Query(context.Background(), `SELECT k || seq FROM `+f.db.Table("effect")+` ORDER BY id`)
	if err != nil {
		f.t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			f.t.Fatal(err)
		}
		out = append(out, s)
	}
	return out
}

// The retry lane on a batched consumer: key A's first message asks for later (2 s) twice, then
// succeeds. Keys B…Z of the same partition are applied meanwhile; A's later messages, in the
// same batches, are parked behind it and applied after it, in order; each message once.
func TestBatchConsumerRetryLane(t *testing.T) {
	t.Parallel()
	f := newBatchFixture(t, 1)
	keys := []string{"A"}
	for c := 'B'; c <= 'Z'; c++ {
		keys = append(keys, string(c))
		if c == 'M' {
			keys = append(keys, "A")
		}
	}
	keys = append(keys, "A")
	msgs := f.produceKeys(map[string]int{}, keys...)
	var (
		mu      sync.Mutex
		tries   int
		firstA1 time.Time
	)
	p := f.ib.Batch("", func(msg *message.Message) ([]*message.Message, error) {
		if msg.Metadata.Get("k") == "A" && msg.Metadata.Get("seq") == "1" {
			mu.Lock()
			tries++
			n := tries
			if n == 1 {
				firstA1 = time.Now()
			}
			mu.Unlock()
			if n <= 2 {
				return nil, inbox.RetryAfter(errors.New("provider down"), 2*time.Second)
			}
		}
		return nil, f.effect(msg)
	})
	f.start(kafkatest.Topic("g"), p, nil)
	waitUntil(t, "B…Z applied", func() bool { return f.count(`SELECT count(*) FROM `+f.db.Table("effect")) >= 25 })
	if got := f.appliedOrder(); strings.Contains(strings.Join(got, ","), "A") {
		t.Fatalf("key A applied before its parked head: %v", got)
	}
	f.waitEffects(len(msgs))
	mu.Lock()
	waited, n := time.Since(firstA1), tries
	mu.Unlock()
	if n != 3 || waited < 4*time.Second {
		t.Errorf("A1 tried %d times, applied %s after its first try; want 3 tries, 2 s apart at least", n, waited)
	}
	f.checkOnceInOrder(msgs)
	if got := f.appliedOrder(); got[len(got)-3] != "A1" {
		t.Errorf("A1 applied before other keys' messages: %v", got)
	}
	if n := f.count(`SELECT count(*) FROM ` + f.db.Table("inbox_parked")); n != 0 {
		t.Errorf("%d rows still parked", n)
	}
	if s := f.metrics.Snapshot(); s.Parked != 3 || s.Poisoned != 0 {
		t.Errorf("metrics: %+v; want 3 parked (A1 at the head, A2 and A3 behind), none poisoned", s)
	}
}

// A consumer process SIGKILLed while key k0's first message is parked, with k0's later messages
// parked behind it: after a restart, every message is applied exactly once, each key in order,
// and the lane is empty.
func TestBatchConsumerKilledWhileAKeyIsParked(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	if _, err := db.Pool.Exec(context.Background(), `CREATE TABLE `+db.Table("effect")+
		` (id bigserial PRIMARY KEY, msg_uuid text NOT NULL, k text NOT NULL DEFAULT '', seq int NOT NULL DEFAULT 0)`); err != nil {
		t.Fatal(err)
	}
	k := kafkatest.Fake(t, 2, kfake.GroupMinSessionTimeout(500*time.Millisecond))
	f := &bfix{t: t, db: db, brokers: k.Brokers(), topic: kafkatest.Topic("lane-kill")}
	msgs := f.produce(1500, 30)
	env := []string{"CHILD_DB_URL=" + db.URL, "CHILD_SCHEMA=" + db.Schema, "CHILD_TOPIC=" + f.topic,
		"CHILD_GROUP=" + kafkatest.Topic("g"), "CHILD_BROKERS=" + strings.Join(k.Brokers(), ",")}
	c := startKChild(t, append(env, "CHILD_LANE=hold", "CHILD_KILL=after-commit:700"))
	c.WaitExit(t, 2*time.Minute)
	if !c.KilledBySIGKILL() {
		t.Fatalf("child was not killed: %v\n%s", c.Cmd.ProcessState, c.Stderr.String())
	}
	if n := f.count(`SELECT count(*) FROM ` + db.Table("inbox_parked") + ` WHERE lane = 'k0'`); n < 2 {
		t.Fatalf("%d rows of k0 parked when the consumer died; want its head and some behind it", n)
	}
	if n := f.count(`SELECT count(*) FROM (SELECT msg_uuid FROM ` + db.Table("effect") + ` GROUP BY 1 HAVING count(*) > 1) d`); n != 0 {
		t.Fatalf("%d messages applied twice", n)
	}
	last := startKChild(t, env) // the provider is back: k0's head succeeds
	f.waitEffects(len(msgs))
	if err := last.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	last.WaitExit(t, 2*time.Minute)
	if code := last.Cmd.ProcessState.ExitCode(); code != 0 {
		t.Fatalf("last child exited %d:\n%s", code, last.Stderr.String())
	}
	f.checkOnceInOrder(msgs)
	if n := f.count(`SELECT count(*) FROM ` + db.Table("inbox_parked")); n != 0 {
		t.Errorf("%d rows still parked", n)
	}
}

// The lane drains while its key keeps arriving: key A's head asks for later three times
// (100 ms each) while A's and B's messages keep coming in small produce calls, so drains that
// empty the lane race with transactions that park behind it. Every message is applied once,
// each key in order, and nothing stays parked.
func TestBatchConsumerRetryLaneUnderTraffic(t *testing.T) {
	t.Parallel()
	f := newBatchFixture(t, 1)
	var counters inbox.Counters
	ib, err := inbox.New(inbox.Config{Pool: f.db.Pool, Schema: f.db.Schema, Consumer: "batch", LaneInterval: 20 * time.Millisecond, Metrics: &counters})
	if err != nil {
		t.Fatal(err)
	}
	var tries atomic.Int32
	p := ib.Batch("", func(msg *message.Message) ([]*message.Message, error) {
		if msg.Metadata.Get("k") == "A" && msg.Metadata.Get("seq") == "1" && tries.Add(1) <= 3 {
			return nil, inbox.RetryAfter(errors.New("provider down"), 100*time.Millisecond)
		}
		return nil, f.effect(msg)
	})
	f.start(kafkatest.Topic("g"), p, nil)
	var msgs []produced
	next := map[string]int{}
	for range 60 {
		msgs = append(msgs, f.produceKeys(next, "A", "B", "A", "A", "B")...)
		time.Sleep(15 * time.Millisecond)
	}
	f.waitEffects(len(msgs))
	f.checkOnceInOrder(msgs)
	waitUntil(t, "the lane empty", func() bool { return f.count(`SELECT count(*) FROM `+f.db.Table("inbox_parked")) == 0 })
	if n := counters.Snapshot().Parked; n < 5 || tries.Load() != 4 {
		t.Errorf("%d messages parked, A1 tried %d times: the lane was not exercised", n, tries.Load())
	}
	t.Logf("%d messages parked", counters.Snapshot().Parked)
}
