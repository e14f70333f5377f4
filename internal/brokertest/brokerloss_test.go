package brokertest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

func TestMain(m *testing.M) { testdb.Main(m) }

const (
	partitions = 12
	writers    = 4
	keysEach   = 6 // keys per writer: 24 keys over 12 partitions
	// drainBound: from the end of the load until the outbox is empty (every row acknowledged
	// by the broker) and every event has its effect. The broker is back long before; what is
	// left is the backlog of the stall plus the consumer catching up.
	drainBound = 20 * time.Second
	// after is how long the load goes on after the broker came back.
	after = 1500 * time.Millisecond
)

// TestBrokerLoss: a kfake cluster of three brokers, one topic of 12 partitions with
// replication factor 3; writers commit events of 24 keys (each key's events in sequence), the
// relay publishes them, a batched inbox consumer applies one effect row per event in the
// transaction of its dedup row. Mid-stream a broker is lost: every connection to it drops and
// its listener closes (a crashed machine: new connections are refused), and it leaves the
// cluster's metadata, so the partitions it led get other leaders; group coordinators on it move
// too. It comes back after 3 s under the same id and port. kfake keeps one copy of every
// partition, shared by the brokers, so a replica that is "in sync" is exactly that; the
// producer's acks=all is what makes this hold on a real cluster with min.insync.replicas ≥ 2.
//
// Asserted for each setting: 0 events lost (every written event is in Kafka and has its
// effect), 0 double effects, per-key order in Kafka (a key's sequence never goes backwards
// except for an exact re-delivery of an event id already seen), the outbox empty and every
// effect applied within drainBound of the load's end. Measured: the publish stall, from the
// loss to the first acknowledged batch of each partition the lost broker led.
//
// kfake's RemoveNode and AddNode re-elect the leader of every partition, not only of those the
// lost broker led: a superset of a real broker loss (with preferred leader election, a real
// cluster moves leaders back when the broker returns, as AddNode does here).
func TestBrokerLoss(t *testing.T) {
	for _, s := range []struct {
		name string
		opts []kgo.Opt
		// down: how long the broker stays lost. stallBound: the longest stall of a moved
		// partition asserted; the figures are logged.
		down, stallBound time.Duration
	}{
		// The relay's production settings: relaykafka.MetadataMinAge (50 ms) and its retry
		// backoff (20 ms to 1 s).
		{"defaults", nil, 3 * time.Second, 2 * time.Second},
		// The settings of the relay's other broker-fault tests.
		{"tests", []kgo.Opt{kgo.RetryBackoffFn(func(int) time.Duration { return 10 * time.Millisecond }), kgo.MetadataMinAge(20 * time.Millisecond)}, 3 * time.Second, 2 * time.Second},
		// franz-go's own default metadata age (5 s), for comparison: what a relay built with
		// kgo defaults would stall. The broker stays away longer than 5 s, so that its return
		// does not end the stall.
		{"franz-go MetadataMinAge 5s", []kgo.Opt{kgo.MetadataMinAge(5 * time.Second)}, 6 * time.Second, 7 * time.Second},
	} {
		t.Run(s.name, func(t *testing.T) {
			t.Parallel()
			f := brokerLoss(t, s.opts, s.down)
			t.Logf("%s: %s", s.name, f)
			if f.StallMax > s.stallBound {
				t.Errorf("a moved partition published nothing for %s after the loss, want ≤ %s", f.StallMax.Round(time.Millisecond), s.stallBound)
			}
		})
	}
}

// figures are what one broker loss cost.
type figures struct {
	Written, InKafka, Duplicates, Effects int
	MovedPartitions                       int
	// StallMin, StallMedian, StallMax: from the loss to the first acknowledged produce of each
	// partition the lost broker led.
	StallMin, StallMedian, StallMax time.Duration
	// Drain: from the end of the load until the outbox was empty; Effects: until every event
	// had its effect.
	Drain, EffectsDone time.Duration
}

func (f figures) String() string {
	return fmt.Sprintf("%d events written, %d records in Kafka (%d duplicates), %d effects; stall of the %d partitions the lost broker led (and written to): min %s, median %s, max %s; outbox empty %s and every effect applied %s after the load stopped",
		f.Written, f.InKafka, f.Duplicates, f.Effects, f.MovedPartitions,
		f.StallMin.Round(time.Millisecond), f.StallMedian.Round(time.Millisecond), f.StallMax.Round(time.Millisecond),
		f.Drain.Round(time.Millisecond), f.EffectsDone.Round(time.Millisecond))
}

// event is a writer's payload.
type event struct {
	Key string `json:"key"`
	Seq int    `json:"seq"`
}

// written is one committed event.
type written struct {
	ID  string
	Key string
	Seq int
}

// stallHook records which partitions the relay writes before the loss, and when each is first
// written by another broker than the lost one after it (an answer of the lost broker that
// arrives after the loss was sent before it).
type stallHook struct {
	lost   atomic.Int32
	lostAt atomic.Int64 // unix nanos; 0 before the loss
	mu     sync.Mutex
	active map[int32]bool      // partitions written before the loss
	first  map[int32]time.Time // partition → first batch acknowledged by a survivor after the loss
}

// OnProduceBatchWritten implements kgo.HookProduceBatchWritten.
func (h *stallHook) OnProduceBatchWritten(meta kgo.BrokerMetadata, _ string, partition int32, _ kgo.ProduceBatchMetrics) {
	now := time.Now()
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.lostAt.Load() == 0 {
		h.active[partition] = true
		return
	}
	if _, ok := h.first[partition]; !ok && meta.NodeID != h.lost.Load() {
		h.first[partition] = now
	}
}

func logger() *slog.Logger {
	level := slog.LevelError
	if os.Getenv("BROKERTEST_LOG") != "" {
		level = slog.LevelInfo
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
}

func brokerLoss(t *testing.T, opts []kgo.Opt, down time.Duration) figures {
	ctx := context.Background()
	db := testdb.New(t)
	k := kafkatest.Fake(t, partitions, kfake.NumBrokers(3))
	brokers := k.Brokers()
	topic := kafkatest.Topic("brokerloss")
	createTopic(t, brokers, topic)
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE `+db.Table("effect")+` (n bigserial PRIMARY KEY, event_id uuid NOT NULL, key text NOT NULL, seq int NOT NULL)`); err != nil {
		t.Fatal(err)
	}

	runCtx, cancel := context.WithCancel(ctx)
	var runs sync.WaitGroup
	goRun := func(name string, run func(context.Context) error) {
		runs.Go(func() {
			if err := run(runCtx); err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("%s stopped with: %v", name, err)
			}
		})
	}
	defer func() { cancel(); runs.Wait() }()

	hook := &stallHook{active: map[int32]bool{}, first: map[int32]time.Time{}}
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: brokers, Opts: append(slices.Clone(opts), kgo.WithHooks(hook))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sink.Close() })
	r, err := relay.New(relay.Config{Pool: db.Pool, Sink: sink, Schema: db.Schema, PollInterval: 20 * time.Millisecond, Logger: logger()})
	if err != nil {
		t.Fatal(err)
	}
	goRun("relay", r.Run)

	ib, err := inbox.New(inbox.Config{Pool: db.Pool, Schema: db.Schema, Consumer: "effects", Logger: logger()})
	if err != nil {
		t.Fatal(err)
	}
	c, err := inboxkafka.NewBatchConsumer(inboxkafka.BatchConfig{Brokers: brokers, Group: "effects", Topics: []string{topic},
		Backoff: 10 * time.Millisecond, MaxBackoff: 200 * time.Millisecond, Logger: logger(),
		Processor: ib.BatchNoPublish(func(msg *message.Message) error {
			var ev event
			if err := json.Unmarshal(msg.Payload, &ev); err != nil {
				return err
			}
			_, err := outbox.MustTx(msg.Context()).Exec(msg.Context(), `INSERT INTO `+db.Table("effect")+` (event_id, key, seq) VALUES ($1, $2, $3)`, msg.UUID, ev.Key, ev.Seq)
			return err
		})})
	if err != nil {
		t.Fatal(err)
	}
	goRun("consumer", c.Run)

	// The load: each writer owns its keys and commits their events one transaction at a time,
	// so a key's sequence is its commit order.
	ow, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu      sync.Mutex
		all     []written
		running atomic.Bool
		load    sync.WaitGroup
	)
	running.Store(true)
	for w := range writers {
		load.Go(func() {
			seqs := make([]int, keysEach)
			for n := 0; running.Load(); n++ {
				i := n % keysEach
				key := "k-" + strconv.Itoa(w) + "-" + strconv.Itoa(i)
				seqs[i]++
				payload, _ := json.Marshal(event{Key: key, Seq: seqs[i]})
				m := outbox.SetPartitionKey(outbox.NewMessage(payload), key)
				tx, err := db.Pool.Begin(ctx)
				if err != nil {
					t.Error(err)
					return
				}
				if err := ow.WriteTx(ctx, tx, topic, m); err != nil {
					_ = tx.Rollback(ctx)
					t.Error(err)
					return
				}
				if err := tx.Commit(ctx); err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				all = append(all, written{ID: m.UUID, Key: key, Seq: seqs[i]})
				mu.Unlock()
				time.Sleep(2 * time.Millisecond) // a steady stream, not a flood
			}
		})
	}
	stopLoad := func() { running.Store(false); load.Wait() }
	defer stopLoad()

	count := func(sql string) int {
		var n int
		if err := db.Pool.QueryRow(ctx, sql).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	// Flowing: effects arrive.
	if _, ok := waitFor(30*time.Second, func() bool { return count(`SELECT count(*) FROM `+db.Table("effect")) >= 200 }); !ok {
		t.Fatal("no effects within 30 s: the stream does not flow")
	}

	// Lose the broker that leads the most partitions.
	leaders := map[int32][]int32{}
	for p := range int32(partitions) {
		n := k.Cluster.LeaderFor(topic, p)
		leaders[n] = append(leaders[n], p)
	}
	lost := int32(0)
	for n, ps := range leaders {
		if len(ps) > len(leaders[lost]) || len(ps) == len(leaders[lost]) && n < lost {
			lost = n
		}
	}
	moved := leaders[lost]
	_, portStr, _ := net.SplitHostPort(brokers[lost]) // kfake numbers its first brokers 0, 1, 2 in order
	port, _ := strconv.Atoi(portStr)
	var isDown atomic.Bool
	isDown.Store(true)
	k.Cluster.Control(func(kmsg.Request) (kmsg.Response, error, bool) {
		k.Cluster.KeepControl()
		if isDown.Load() && k.Cluster.CurrentNode() == lost {
			return nil, errors.New("broker lost"), true // the connection drops
		}
		return nil, nil, false
	})
	hook.lost.Store(lost)
	lostAt := time.Now()
	hook.lostAt.Store(lostAt.UnixNano())
	if err := k.Cluster.RemoveNode(lost); err != nil {
		t.Fatal(err)
	}
	t.Logf("broker %d lost: it led partitions %v", lost, moved)
	time.Sleep(down)
	isDown.Store(false)
	if _, _, err := k.Cluster.AddNode(lost, port); err != nil {
		t.Fatalf("bring broker %d back on port %d: %v", lost, port, err)
	}
	t.Logf("broker %d back after %s", lost, time.Since(lostAt).Round(time.Millisecond))
	time.Sleep(after)
	stopLoad()
	stopped := time.Now()

	var f figures
	var ok bool
	if f.Drain, ok = waitFor(drainBound, func() bool { return count(`SELECT count(*) FROM `+db.Table("outbox")) == 0 }); !ok {
		t.Errorf("%d rows still in the outbox %s after the load stopped", count(`SELECT count(*) FROM `+db.Table("outbox")), drainBound)
	}
	mu.Lock()
	want := slices.Clone(all)
	mu.Unlock()
	f.Written = len(want)
	if f.EffectsDone, ok = waitFor(drainBound-time.Since(stopped)+f.Drain, func() bool {
		return count(`SELECT count(DISTINCT event_id) FROM `+db.Table("effect")) >= len(want)
	}); !ok {
		t.Errorf("effects of %d of %d events after %s", count(`SELECT count(DISTINCT event_id) FROM `+db.Table("effect")), len(want), drainBound)
	}
	f.EffectsDone = time.Since(stopped)

	// Stall of each partition the lost broker led.
	hook.mu.Lock()
	var stalls []time.Duration
	moved = slices.DeleteFunc(moved, func(p int32) bool { return !hook.active[p] }) // no key hashes to it
	for _, p := range moved {
		if at, ok := hook.first[p]; ok {
			stalls = append(stalls, at.Sub(lostAt))
		} else {
			t.Errorf("partition %d (led by the lost broker) never published after the loss", p)
		}
	}
	hook.mu.Unlock()
	f.MovedPartitions = len(moved)
	if len(stalls) > 0 {
		slices.Sort(stalls)
		f.StallMin, f.StallMedian, f.StallMax = stalls[0], stalls[len(stalls)/2], stalls[len(stalls)-1]
	}

	// Kafka: every event, per-key order.
	recs := readTopic(t, brokers, topic)
	f.InKafka = len(recs)
	seen := map[string]bool{}
	last := map[string]int{}
	for _, r := range recs {
		if seen[r.ID] {
			f.Duplicates++
			continue // an exact re-delivery of an event already seen: allowed
		}
		seen[r.ID] = true
		if r.Seq <= last[r.Key] {
			t.Errorf("key %s: seq %d (event %s, partition %d offset %d) after seq %d: order broken", r.Key, r.Seq, r.ID, r.Partition, r.Offset, last[r.Key])
		}
		last[r.Key] = r.Seq
	}
	var missing int
	for _, w := range want {
		if !seen[w.ID] {
			missing++
		}
	}
	if missing > 0 {
		t.Errorf("%d of %d committed events never reached Kafka", missing, len(want))
	}

	// Effects: one per event, none doubled.
	f.Effects = count(`SELECT count(*) FROM ` + db.Table("effect"))
	if d := count(`SELECT count(*) FROM (SELECT event_id FROM ` + db.Table("effect") + ` GROUP BY event_id HAVING count(*) > 1) d`); d > 0 {
		t.Errorf("%d events with more than one effect", d)
	}
	if f.Effects != len(want) {
		t.Errorf("%d effects for %d events", f.Effects, len(want))
	}
	return f
}

// createTopic creates topic with replication factor 3 and checks that the metadata says so.
func createTopic(t *testing.T, brokers []string, topic string) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := adm.CreateTopic(ctx, partitions, 3, nil, topic); err != nil {
		t.Fatal(err)
	}
	td, err := adm.ListTopics(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range td[topic].Partitions {
		if len(p.Replicas) != 3 || len(p.ISR) != 3 {
			t.Fatalf("partition %d: replicas %v, ISR %v; want 3 of each", p.Partition, p.Replicas, p.ISR)
		}
	}
}

// record is one Kafka record of the topic.
type record struct {
	ID        string
	Key       string
	Seq       int
	Partition int32
	Offset    int64
}

// readTopic reads every record of topic from the start, in partition and offset order (until
// a poll finds nothing new five times in a row).
func readTopic(t *testing.T, brokers []string, topic string) []record {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var out []record
	for idle := 0; idle < 5; {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		fs := cl.PollFetches(ctx)
		cancel()
		n := 0
		fs.EachRecord(func(r *kgo.Record) {
			n++
			var ev event
			_ = json.Unmarshal(r.Value, &ev)
			rec := record{Key: string(r.Key), Seq: ev.Seq, Partition: r.Partition, Offset: r.Offset}
			for _, h := range r.Headers {
				if h.Key == relaykafka.UUIDHeader {
					rec.ID = string(h.Value)
				}
			}
			out = append(out, rec)
		})
		if n == 0 {
			idle++
		} else {
			idle = 0
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Partition != out[j].Partition {
			return out[i].Partition < out[j].Partition
		}
		return out[i].Offset < out[j].Offset
	})
	return out
}

// waitFor polls cond every 20 ms until it holds or limit passes; it returns how long it took
// and whether it held.
func waitFor(limit time.Duration, cond func() bool) (time.Duration, bool) {
	t0 := time.Now()
	for {
		if cond() {
			return time.Since(t0), true
		}
		if time.Since(t0) > limit {
			return time.Since(t0), false
		}
		time.Sleep(20 * time.Millisecond)
	}
}
