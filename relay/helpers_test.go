package relay_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// inCI reports whether the tests run in CI, where long tests are shortened (never skipped).
func inCI() bool { return os.Getenv("CI") != "" }

// testLogger sends relay logs to the test log when -v, and discards them otherwise.
func testLogger(t testing.TB) *slog.Logger {
	if !testing.Verbose() {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: testLogLevel()}))
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

var _ io.Writer = tWriter{}

// written is one event as the test wrote it.
type written struct {
	EventID string
	Key     string
	Seq     int // per-key sequence number, in write order
}

// writeEvents writes n events spread round-robin over `keys` keys (keys == 0: no key), perTx
// per transaction, and returns them in write order. Payload = "<key>/<seq>".
func writeEvents(t testing.TB, db *testdb.DB, topic string, n, keys, perTx int) []written {
	t.Helper()
	return writeEventsPrefix(t, db, topic, n, keys, perTx, "key-")
}

// writeEventsPrefix is writeEvents with keys named prefix+number, so several calls in one test
// write distinct keys (sequence numbers restart per call).
func writeEventsPrefix(t testing.TB, db *testdb.DB, topic string, n, keys, perTx int, prefix string) []written {
	t.Helper()
	ctx := context.Background()
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	seq := map[string]int{}
	var out []written
	for start := 0; start < n; start += perTx {
		var batch []*message.Message
		for i := start; i < start+perTx && i < n; i++ {
			key := ""
			if keys > 0 {
				key = prefix + strconv.Itoa(i%keys)
			}
			s := seq[key]
			seq[key]++
			m := outbox.NewMessage([]byte(fmt.Sprintf("%s/%d", key, s)))
			if key != "" {
				outbox.SetPartitionKey(m, key)
			}
			m.Metadata.Set("seq", strconv.Itoa(s))
			batch = append(batch, m)
			out = append(out, written{EventID: m.UUID, Key: key, Seq: s})
		}
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return w.WriteTx(ctx, tx, topic, batch...) }); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// consumed is one record read back from Kafka.
type consumed struct {
	Key     string
	EventID string
	Value   string
	Headers map[string]string
	Offset  int64
	Part    int32
}

// consumer reads a topic from the start in the background.
type consumer struct {
	cl   *kgo.Client
	mu   sync.Mutex
	recs []consumed
	ids  map[string]bool
	cond chan struct{}
	done chan struct{}
}

func newConsumer(t testing.TB, brokers []string, topic string) *consumer {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	c := &consumer{cl: cl, ids: map[string]bool{}, cond: make(chan struct{}, 1), done: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		defer close(c.done)
		for ctx.Err() == nil {
			fs := cl.PollFetches(ctx)
			fs.EachRecord(func(r *kgo.Record) {
				rec := consumed{Key: string(r.Key), Value: string(r.Value), Headers: map[string]string{}, Offset: r.Offset, Part: r.Partition}
				for _, h := range r.Headers {
					rec.Headers[h.Key] = string(h.Value)
				}
				rec.EventID = rec.Headers[relaykafka.UUIDHeader]
				c.mu.Lock()
				c.recs = append(c.recs, rec)
				c.ids[rec.EventID] = true
				c.mu.Unlock()
			})
			select {
			case c.cond <- struct{}{}:
			default:
			}
		}
	}()
	t.Cleanup(func() { cancel(); <-c.done; cl.Close() })
	return c
}

// waitDistinct waits until n distinct event ids were read, or fails the test after timeout.
func (c *consumer) waitDistinct(t testing.TB, n int, timeout time.Duration) []consumed {
	t.Helper()
	deadline := time.After(timeout)
	for {
		c.mu.Lock()
		got := len(c.ids)
		c.mu.Unlock()
		if got >= n {
			return c.snapshot()
		}
		select {
		case <-c.cond:
		case <-time.After(100 * time.Millisecond):
		case <-deadline:
			t.Fatalf("consumed %d distinct events, want %d, within %s", got, n, timeout)
		}
	}
}

func (c *consumer) snapshot() []consumed {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]consumed(nil), c.recs...)
}

func (c *consumer) distinct() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.ids)
}

// checkDelivery asserts the relay's guarantees on what was consumed: every written event is
// there, every duplicate carries the same id as its original (same payload ↔ same id), and
// within each key the first occurrences are in write order. It returns the duplicate count.
func checkDelivery(t testing.TB, want []written, got []consumed) int {
	t.Helper()
	byID := map[string]written{}
	for _, w := range want {
		byID[w.EventID] = w
	}
	seen := map[string]bool{}
	idOfPayload := map[string]string{}
	next := map[string]int{} // per key: next expected seq of a first occurrence
	dups := 0
	for _, r := range got {
		w, ok := byID[r.EventID]
		if !ok {
			t.Fatalf("consumed unknown event id %q (payload %q)", r.EventID, r.Value)
		}
		if prev, ok := idOfPayload[r.Value]; ok && prev != r.EventID {
			t.Fatalf("payload %q delivered with two ids %s and %s", r.Value, prev, r.EventID)
		}
		idOfPayload[r.Value] = r.EventID
		if want := fmt.Sprintf("%s/%d", w.Key, w.Seq); r.Value != want {
			t.Fatalf("event %s carries payload %q, want %q", r.EventID, r.Value, want)
		}
		if r.Key != w.Key {
			t.Fatalf("event %s has Kafka key %q, want %q", r.EventID, r.Key, w.Key)
		}
		if seen[r.EventID] {
			dups++
			continue
		}
		seen[r.EventID] = true
		if w.Key != "" {
			if w.Seq != next[w.Key] {
				t.Fatalf("key %s: first occurrence of seq %d came when seq %d was expected (per-key order broken)", w.Key, w.Seq, next[w.Key])
			}
			next[w.Key]++
		}
	}
	for _, w := range want {
		if !seen[w.EventID] {
			t.Fatalf("event %s (key %q seq %d) never reached Kafka", w.EventID, w.Key, w.Seq)
		}
	}
	return dups
}

// outboxCount returns the rows left in the outbox.
func outboxCount(t testing.TB, db *testdb.DB) int {
	t.Helper()
	var n int
	if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+db.Table("outbox")).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// startRelay runs a relay in the background and returns a stop function that cancels it and
// waits for Run to return (failing the test if it returned an error).
func startRelay(t testing.TB, r *relay.Relay) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- r.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-errc:
				if err != nil {
					t.Errorf("relay.Run: %v", err)
				}
			case <-time.After(60 * time.Second):
				t.Errorf("relay.Run did not return within 60s of cancellation")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// newKafkaRelay builds a relay with a Kafka sink on brokers.
func newKafkaRelay(t testing.TB, db *testdb.DB, brokers []string, cfg relay.Config) *relay.Relay {
	t.Helper()
	return newKafkaRelayWith(t, db, relaykafka.Config{Brokers: brokers}, cfg)
}

// fastRetries are client options for fault tests: retry and refresh metadata quickly, so a
// test with many injected faults does not spend its time in the client's default backoffs.
var fastRetries = []kgo.Opt{
	kgo.RetryBackoffFn(func(int) time.Duration { return 10 * time.Millisecond }),
	kgo.MetadataMinAge(20 * time.Millisecond),
}

func newKafkaRelayWith(t testing.TB, db *testdb.DB, kcfg relaykafka.Config, cfg relay.Config) *relay.Relay {
	t.Helper()
	sink, err := relaykafka.NewSink(kcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sink.Close() })
	cfg.Schema = db.Schema
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	cfg.Pool, cfg.Sink = db.Pool, sink
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// recorder is a relay.Metrics that remembers what it was told, so tests can wait for state
// changes instead of sleeping.
type recorder struct {
	relay.NopMetrics // methods added to relay.Metrics later are no-ops here

	mu        sync.Mutex
	owned     int
	published int
	failed    map[relay.FailureKind]int
	parked    int
	pending   int64
	failCalls int // Failed calls: one per sink call with failures
	changed   chan struct{}
}

func newRecorder() *recorder {
	return &recorder{failed: map[relay.FailureKind]int{}, owned: -1, changed: make(chan struct{}, 1)}
}

func (r *recorder) note(f func()) {
	r.mu.Lock()
	f()
	r.mu.Unlock()
	select {
	case r.changed <- struct{}{}:
	default:
	}
}

func (r *recorder) Published(n int, _ time.Duration) { r.note(func() { r.published += n }) }
func (r *recorder) Failed(kind relay.FailureKind, n int) {
	r.note(func() { r.failed[kind] += n; r.failCalls++ })
}
func (r *recorder) Parked(n int)                        { r.note(func() { r.parked += n }) }
func (r *recorder) OwnedShards(n int)                   { r.note(func() { r.owned = n }) }
func (r *recorder) Pending(rows int64, _ time.Duration) { r.note(func() { r.pending = rows }) }

// waitFor waits until cond (evaluated under the lock) holds.
func (r *recorder) waitFor(t testing.TB, timeout time.Duration, what string, cond func(*recorder) bool) {
	t.Helper()
	deadline := time.After(timeout)
	for {
		r.mu.Lock()
		ok := cond(r)
		r.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-r.changed:
		case <-time.After(50 * time.Millisecond):
		case <-deadline:
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
	}
}

// eventually polls cond until it holds or fails the test after timeout.
func eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func testLogLevel() slog.Level {
	if os.Getenv("RELAY_TEST_DEBUG") != "" {
		return slog.LevelDebug
	}
	return slog.LevelInfo
}
