package inboxkafka_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// The tests of this file hold the BatchConsumer to issue 23's failure rules: whose a failure
// is (the batch's: retried without counting an attempt; or the message's: attempts, then
// poison), and that a partition whose message backs off holds up no other partition.

// fixtureOn is newBatchFixture on a database of the test's choice (a server of its own).
func fixtureOn(t *testing.T, db *testdb.DB, partitions int32) *bfix {
	t.Helper()
	if _, err := db.Pool.Exec(context.Background(), `CREATE TABLE `+db.Table("effect")+
		` (id bigserial PRIMARY KEY, msg_uuid text NOT NULL, k text NOT NULL DEFAULT '', seq int NOT NULL DEFAULT 0)`); err != nil {
		t.Fatal(err)
	}
	f := &bfix{t: t, db: db, brokers: kafkatest.Brokers(t, partitions), topic: kafkatest.Topic("batch"), metrics: &inbox.Counters{}}
	ib, err := inbox.New(inbox.Config{Pool: db.Pool, Schema: db.Schema, Consumer: "batch", Metrics: f.metrics})
	if err != nil {
		t.Fatal(err)
	}
	f.ib = ib
	return f
}

// produceTo sends n messages of key to partition part, numbered first, first+1, … within the
// key, in one produce call (so one fetch usually returns them together).
func (f *bfix) produceTo(part int32, key string, first, n int) []produced {
	f.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(f.brokers...), kgo.DefaultProduceTopic(f.topic), kgo.AllowAutoTopicCreation(),
		kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		f.t.Fatal(err)
	}
	defer cl.Close()
	out := make([]produced, n)
	recs := make([]*kgo.Record, n)
	for i := range n {
		out[i] = produced{uuid: outbox.NewUUID(), key: key, seq: first + i}
		recs[i] = &kgo.Record{Partition: part, Key: []byte(key), Value: []byte(`{}`), Headers: []kgo.RecordHeader{
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

func (f *bfix) poisonCount() int {
	f.t.Helper()
	return f.count(`SELECT count(*) FROM ` + f.db.Table("inbox_poison"))
}

// events is the order in which the consumer settled messages: "applied <uuid>" once a
// transaction holding the message committed, "poison <uuid>" when a message is given up.
type events struct {
	mu   sync.Mutex
	list []string
}

func (e *events) add(s string) {
	e.mu.Lock()
	e.list = append(e.list, s)
	e.mu.Unlock()
}

func (e *events) snapshot() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.list...)
}

// recording is a BatchProcessor that writes its settlements into events.
type recording struct {
	inbox.BatchProcessor
	ev *events
}

func (r recording) ProcessBatch(ctx context.Context, msgs []*message.Message) error {
	err := r.BatchProcessor.ProcessBatch(ctx, msgs)
	if err == nil {
		for _, m := range msgs {
			r.ev.add("applied " + m.UUID)
		}
	}
	return err
}

func (r recording) SettlePoison(ctx context.Context, msg *message.Message, p inbox.GiveUp) error {
	r.ev.add("poison " + msg.UUID)
	return r.BatchProcessor.SettlePoison(ctx, msg, p)
}

// waitFor waits until cond holds, or fails the test after a generous deadline.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after 90 s waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Issue 23: "BatchConsumer holds its worker slot while a message sleeps in backoff". With
// Workers = 2 and a failing message at the head of partitions 0 and 1, each backing off for
// seconds between attempts, the healthy messages of partitions 2 and 3 must all be applied
// before either failing message is given up: a message waiting for its next attempt holds no
// worker slot.
func TestBatchConsumerBackoffHoldsNoWorkerSlot(t *testing.T) {
	t.Parallel()
	f := newBatchFixture(t, 4)
	bad := append(f.produceTo(0, "p0", 1, 1), f.produceTo(1, "p1", 1, 1)...)
	isBad := map[string]bool{bad[0].uuid: true, bad[1].uuid: true}
	var mu sync.Mutex
	tries := map[string]int{}
	firstTries := make(chan struct{}, 2)
	ev := &events{}
	p := recording{ev: ev, BatchProcessor: f.ib.Batch("", func(msg *message.Message) ([]*message.Message, error) {
		if isBad[msg.UUID] {
			mu.Lock()
			tries[msg.UUID]++
			first := tries[msg.UUID] == 1
			mu.Unlock()
			if first {
				firstTries <- struct{}{}
			}
			return nil, errors.New("the handler cannot apply this message")
		}
		return nil, f.effect(msg)
	})}
	// Attempts 2 and 3 come 3 s and 6 s after the one before: each failing message is given
	// up about 9 s after its first attempt and waits for its retries meanwhile, time enough
	// for 40 healthy messages even on a loaded machine. The assertion is on the order of
	// events, not on how long anything took.
	f.start(kafkatest.Topic("g"), p, func(c *inboxkafka.BatchConfig) {
		c.Workers = 2
		c.MaxAttempts = 3
		c.Backoff, c.MaxBackoff = 3*time.Second, 6*time.Second
	})
	for range 2 {
		select {
		case <-firstTries:
		case <-time.After(90 * time.Second):
			t.Fatal("the failing messages were not tried within 90 s")
		}
	}
	// Both failing messages had their first attempt and now back off. Only now do the healthy
	// partitions get messages, so both failing partitions had a worker slot first.
	healthy := append(f.produceTo(2, "p2", 1, 20), f.produceTo(3, "p3", 1, 20)...)
	waitPoison(t, f, bad[0].uuid)
	waitPoison(t, f, bad[1].uuid)
	f.waitEffects(len(healthy))
	f.checkOnceInOrder(healthy)

	list := ev.snapshot()
	firstPoison := -1
	for i, e := range list {
		if strings.HasPrefix(e, "poison ") {
			firstPoison = i
			break
		}
	}
	applied, late := 0, 0
	for i, e := range list {
		if strings.HasPrefix(e, "applied ") {
			applied++
			if i > firstPoison {
				late++
			}
		}
	}
	if applied < len(healthy) { // more only if a rebalance redelivered some
		t.Fatalf("%d applied events for %d healthy messages: %v", applied, len(healthy), list)
	}
	if late > 0 {
		t.Fatalf("%d of %d healthy messages were applied only after a failing message of another partition was given up: "+
			"a message waiting for its retry held a worker slot (events: %v)", late, len(healthy), list)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, b := range bad {
		if tries[b.uuid] != 3 {
			t.Errorf("failing message %s tried %d times, want MaxAttempts = 3", b.uuid, tries[b.uuid])
		}
	}
}

// lineWatch is a log destination that passes lines on to the test log and signals each line
// containing want.
type lineWatch struct {
	t    *testing.T
	want string
	hits chan string
}

func (w lineWatch) Write(p []byte) (int, error) {
	s := strings.TrimSpace(string(p))
	w.t.Log(s)
	if strings.Contains(s, w.want) {
		select {
		case w.hits <- s:
		default:
		}
	}
	return len(p), nil
}

// Issue 23: "a batched consumer that starts while PostgreSQL restarts exits at once: its
// schema check reports connection refused as fatal". Started while its PostgreSQL is down,
// the consumer waits for it (Run does not return; the log says it is waiting, once a round),
// and once the server is back it applies every message once. An unmigrated schema is still
// fatal at once: TestBatchConsumerRefusesAnUnmigratedSchema.
func TestBatchConsumerStartedWhilePostgresIsDownWaitsForIt(t *testing.T) {
	t.Parallel()
	srv, db := testdb.NewServer(t)
	f := fixtureOn(t, db, 2)
	msgs := f.produce(40, 4)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := srv.Halt(ctx); err != nil {
		t.Fatal(err)
	}
	watch := lineWatch{t: t, want: "waiting for the database", hits: make(chan string, 16)}
	c, err := inboxkafka.NewBatchConsumer(inboxkafka.BatchConfig{Brokers: f.brokers, Group: kafkatest.Topic("g"), Topics: []string{f.topic},
		Processor: f.ib.BatchNoPublish(f.effect), Backoff: 20 * time.Millisecond, MaxBackoff: 100 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(watch, &slog.HandlerOptions{Level: slog.LevelInfo}))})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(context.Background())
	defer stop()
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	stopped := false
	defer func() {
		if !stopped {
			stop()
			<-done
		}
	}()
	// Three rounds of waiting, and Run is still running.
	for round := 1; round <= 3; round++ {
		select {
		case err := <-done:
			stopped = true
			t.Fatalf("Run returned while PostgreSQL was down (round %d): %v; want it to wait for the database", round, err)
		case <-watch.hits:
		case <-time.After(90 * time.Second):
			t.Fatalf("no log line saying the consumer waits for the database within 90 s (round %d)", round)
		}
	}
	select {
	case err := <-done:
		stopped = true
		t.Fatalf("Run returned while PostgreSQL was down: %v", err)
	default:
	}
	if err := srv.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	f.waitEffects(len(msgs))
	stop()
	stopped = true
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	f.checkOnceInOrder(msgs)
	if n := f.poisonCount(); n != 0 {
		t.Fatalf("%d messages poisoned", n)
	}
}

// Issue 23: "a connection lost mid-statement counts as the message's attempt (docs/inbox.md
// promises an outage poisons nothing)". With MaxAttempts = 1, the handler's first run loses
// its backend connection in the middle of a statement (the network path is cut): that is the
// batch's failure, not the message's. The batch runs again, the message is applied exactly
// once, and nothing is given up as poison.
func TestBatchConsumerLostConnectionPoisonsNothing(t *testing.T) {
	t.Parallel()
	f := newBatchFixture(t, 1)
	// The consumer's inbox reaches PostgreSQL through a proxy the test can cut; the test's own
	// pool (f.db.Pool) connects directly.
	px := testdb.NewProxy(t, f.db)
	ib, err := inbox.New(inbox.Config{Pool: px.Pool(t, f.db, 4), Schema: f.db.Schema, Consumer: "batch"})
	if err != nil {
		t.Fatal(err)
	}
	msgs := f.produce(10, 2)
	target := msgs[4].uuid
	var runs atomic.Int64
	var cutter sync.WaitGroup
	t.Cleanup(cutter.Wait)
	cutErr := make(chan error, 1)
	p := ib.BatchNoPublish(func(msg *message.Message) error {
		if err := f.effect(msg); err != nil {
			return err
		}
		if msg.UUID != target || runs.Add(1) > 1 {
			return nil
		}
		// First run of the target: its connection is cut while it sleeps in a statement.
		tx := outbox.MustTx(msg.Context())
		pid := tx.Conn().PgConn().PID()
		cutter.Add(1)
		go func() {
			defer cutter.Done()
			cutErr <- px.CutWhileSleeping(context.Background(), f.db, pid)
		}()
		_, err := tx.Exec(msg.Context(), `SELECT pg_sleep(60)`)
		if err == nil {
			return errors.New("pg_sleep(60) returned although its connection was cut")
		}
		return err
	})
	f.start(kafkatest.Topic("g"), p, func(c *inboxkafka.BatchConfig) { c.MaxAttempts = 1 })
	waitFor(t, "every message applied, or one given up", func() bool {
		return f.poisonCount() > 0 || f.count(`SELECT count(DISTINCT msg_uuid) FROM `+f.db.Table("effect")) == len(msgs)
	})
	if err := <-cutErr; err != nil {
		t.Fatal(err)
	}
	if n := f.poisonCount(); n != 0 {
		var reason string
		_ = f.db.Pool.QueryRow(context.Background(), `SELECT error FROM `+f.db.Table("inbox_poison")).Scan(&reason)
		t.Fatalf("%d messages poisoned by a lost connection (MaxAttempts = 1): %s", n, reason)
	}
	if n := runs.Load(); n < 2 {
		t.Fatalf("the message whose connection was lost ran %d times, want a retry", n)
	}
	f.checkOnceInOrder(msgs)
	if n := f.count(`SELECT count(*) FROM `+f.db.Table("processed_event")+` WHERE dedup_key = $1`, "event:"+target); n != 1 {
		t.Fatalf("%d dedup rows for the message whose connection was lost, want 1", n)
	}
}

// Issue 23: "pgx's conn busy from a handler bug counts as transient, so the batch is retried
// forever and the partition never moves". A handler that returns with a query's rows still
// open fails its own message (pgsql.ErrRowsOpen): the message is given up after MaxAttempts,
// and the partition moves on (later messages applied, in order).
func TestBatchConsumerPoisonsAHandlerThatLeavesRowsOpen(t *testing.T) {
	t.Parallel()
	f := newBatchFixture(t, 1)
	msgs := f.produce(20, 3)
	bad := msgs[7].uuid
	var badTries atomic.Int64
	p := f.ib.Batch("", func(msg *message.Message) ([]*message.Message, error) {
		if err := f.effect(msg); err != nil {
			return nil, err
		}
		if msg.UUID == bad {
			badTries.Add(1)
			// A handler bug: the rows are never closed.
			if _, err := outbox.MustTx(msg.Context()).Query(msg.Context(), `SELECT generate_series(1, 10000)`); err != nil {
				return nil, err
			}
		}
		return nil, nil
	})
	f.start(kafkatest.Topic("g"), p, func(c *inboxkafka.BatchConfig) { c.MaxAttempts = 2 })
	waitPoison(t, f, bad)
	f.waitEffects(len(msgs) - 1)
	var good []produced
	for _, m := range msgs {
		if m.uuid != bad {
			good = append(good, m)
		}
	}
	f.checkOnceInOrder(good)
	var attempts int
	var reason string
	if err := f.db.Pool.QueryRow(context.Background(), `SELECT attempts, error FROM `+f.db.Table("inbox_poison")+` WHERE message_uuid = $1`, bad).
		Scan(&attempts, &reason); err != nil {
		t.Fatal(err)
	}
	if attempts != 2 || !strings.Contains(reason, "rows still open") {
		t.Fatalf("poison row: attempts %d, error %q; want 2 attempts and an error naming the open rows", attempts, reason)
	}
	if n := badTries.Load(); n != 2 {
		t.Fatalf("the handler ran %d times for the message that leaves rows open, want MaxAttempts = 2", n)
	}
	if n := f.poisonCount(); n != 1 {
		t.Fatalf("%d poison rows, want 1", n)
	}
}

// Issue 23: "a deadlock inside a batch is the batch's, never a message's: retried at once
// without counting an attempt". Two partitions' first batches update the same two hot rows in
// opposite orders and meet in the middle, so PostgreSQL aborts one of them with a deadlock.
// With MaxAttempts = 1 and a backoff of ten minutes, the victim batch must be retried at once
// (not after the backoff) and no message counted an attempt: nothing poisoned, every effect
// once, every hot-row update once.
func TestBatchConsumerRetriesADeadlockedBatchAtOnce(t *testing.T) {
	t.Parallel()
	f := newBatchFixture(t, 2)
	hot := f.db.Table("hot")
	if _, err := f.db.Pool.Exec(context.Background(), `CREATE TABLE `+hot+` (id int PRIMARY KEY, n int NOT NULL);
		INSERT INTO `+hot+` VALUES (1, 0), (2, 0)`); err != nil {
		t.Fatal(err)
	}
	// Partition 0 updates row 1 then row 2; partition 1 row 2 then row 1. Each partition's two
	// messages go out in one produce call, so its first batch holds both.
	p0 := f.produceTo(0, "p0", 1, 2)
	p1 := f.produceTo(1, "p1", 1, 2)
	row := map[string]int{p0[0].uuid: 1, p0[1].uuid: 2, p1[0].uuid: 2, p1[1].uuid: 1}
	// The first message of each partition waits, after its update, until the other
	// partition's first message made its own: then both take the second row, each the other's.
	var arrived sync.WaitGroup
	arrived.Add(2)
	var once [2]sync.Once
	first := map[string]int{p0[0].uuid: 0, p1[0].uuid: 1}
	var deadlocks atomic.Int64
	p := f.ib.Batch("", func(msg *message.Message) ([]*message.Message, error) {
		tx := outbox.MustTx(msg.Context())
		if _, err := tx.Exec(msg.Context(), `UPDATE `+hot+` SET n = n + 1 WHERE id = $1`, row[msg.UUID]); err != nil {
			if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) && pgErr.Code == "40P01" {
				deadlocks.Add(1)
			}
			return nil, err
		}
		if i, ok := first[msg.UUID]; ok {
			once[i].Do(func() {
				arrived.Done()
				met := make(chan struct{})
				go func() { arrived.Wait(); close(met) }()
				select {
				case <-met:
				case <-time.After(30 * time.Second): // the other partition's batch did not come: no deadlock, the test says so
				}
			})
		}
		return nil, f.effect(msg)
	})
	f.start(kafkatest.Topic("g"), p, func(c *inboxkafka.BatchConfig) {
		c.MaxAttempts = 1
		c.Backoff, c.MaxBackoff = 10*time.Minute, 10*time.Minute
	})
	f.waitEffects(4)
	if deadlocks.Load() == 0 {
		t.Fatal("the two batches did not deadlock; the test did not test anything")
	}
	f.checkOnceInOrder(append(p0, p1...))
	if n := f.poisonCount(); n != 0 {
		t.Fatalf("%d messages poisoned by a deadlock", n)
	}
	if n := f.count(`SELECT count(*) FROM ` + hot + ` WHERE n <> 2`); n != 0 {
		t.Fatalf("%d hot rows not updated exactly twice", n)
	}
}

// Issue 23: "a COMMIT-time deferred constraint violation counts as transient, so the batch is
// retried forever and the partition never moves". A handler's insert that violates a
// DEFERRABLE INITIALLY DEFERRED unique constraint fails only at COMMIT, where no handler is
// running: the consumer splits the batch down to the message that causes it, which fails its
// attempts and is given up; every other message is applied once, in order.
func TestBatchConsumerPoisonsADeferredConstraintViolation(t *testing.T) {
	t.Parallel()
	f := newBatchFixture(t, 1)
	uniq := f.db.Table("uniq")
	if _, err := f.db.Pool.Exec(context.Background(), `CREATE TABLE `+uniq+` (v text, CONSTRAINT uniq_v UNIQUE (v) DEFERRABLE INITIALLY DEFERRED);
		INSERT INTO `+uniq+` VALUES ('taken')`); err != nil {
		t.Fatal(err)
	}
	msgs := f.produce(12, 2)
	bad := msgs[5].uuid
	var badTries atomic.Int64
	p := f.ib.Batch("", func(msg *message.Message) ([]*message.Message, error) {
		v := msg.UUID
		if msg.UUID == bad {
			badTries.Add(1)
			v = "taken" // violates uniq_v, but only at COMMIT
		}
		if _, err := outbox.MustTx(msg.Context()).Exec(msg.Context(), `INSERT INTO `+uniq+` VALUES ($1)`, v); err != nil {
			return nil, err
		}
		return nil, f.effect(msg)
	})
	f.start(kafkatest.Topic("g"), p, func(c *inboxkafka.BatchConfig) { c.MaxAttempts = 2 })
	waitPoison(t, f, bad)
	f.waitEffects(len(msgs) - 1)
	var good []produced
	for _, m := range msgs {
		if m.uuid != bad {
			good = append(good, m)
		}
	}
	f.checkOnceInOrder(good)
	var attempts int
	var reason string
	if err := f.db.Pool.QueryRow(context.Background(), `SELECT attempts, error FROM `+f.db.Table("inbox_poison")+` WHERE message_uuid = $1`, bad).
		Scan(&attempts, &reason); err != nil {
		t.Fatal(err)
	}
	if attempts != 2 || !strings.Contains(reason, "uniq_v") {
		t.Fatalf("poison row: attempts %d, error %q; want 2 attempts and the constraint's error", attempts, reason)
	}
	if n := f.poisonCount(); n != 1 {
		t.Fatalf("%d poison rows, want 1", n)
	}
	if n := f.count(`SELECT count(*) FROM ` + uniq); n != len(msgs) { // 'taken' and one per good message
		t.Fatalf("%d rows in uniq, want %d", n, len(msgs))
	}
}

// Issue 23: "the record's topic is dropped (spans named process, message.SubscribeTopicFromCtx
// empty for reused router handlers)". A record the relay's Kafka sink publishes, read by the
// BatchConsumer: the router handler reused through ib.Batch sees the message as the relay
// wrote it (event id, payload, metadata) and the source topic in
// message.SubscribeTopicFromCtx, and the message's `process <topic>` span is named with the
// topic, a child of the creation context that travelled in the record's headers.
func TestBatchConsumerRoundTripFromTheRelaySink(t *testing.T) {
	t.Parallel()
	f := newBatchFixture(t, 2)
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	ib, err := inbox.New(inbox.Config{Pool: f.db.Pool, Schema: f.db.Schema, Consumer: "roundtrip", TracerProvider: tp,
		Propagator: propagation.TraceContext{}})
	if err != nil {
		t.Fatal(err)
	}

	// The creation context, as outbox.Writer puts it in a row's metadata.
	pctx, parent := tp.Tracer("test").Start(context.Background(), "create "+f.topic)
	md := map[string]string{"k": "order-7", "seq": "1", "tenant": "acme"}
	propagation.TraceContext{}.Inject(pctx, propagation.MapCarrier(md))
	parent.End()
	eventID := outbox.NewUUID()
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: f.brokers})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sink.Close() }()
	errs := make([]error, 1)
	sink.Publish(context.Background(), []*relay.Message{{ID: 1, EventID: eventID, Topic: f.topic, Key: "order-7",
		Payload: []byte(`{"order":7}`), Metadata: md}}, errs)
	if errs[0] != nil {
		t.Fatalf("relay sink: %v", errs[0])
	}

	type seen struct {
		uuid, topic, payload, tenant string
	}
	got := make(chan seen, 4)
	p := ib.Batch("", func(msg *message.Message) ([]*message.Message, error) {
		got <- seen{uuid: msg.UUID, topic: message.SubscribeTopicFromCtx(msg.Context()), payload: string(msg.Payload), tenant: msg.Metadata.Get("tenant")}
		return nil, f.effect(msg)
	})
	f.start(kafkatest.Topic("g"), p, nil)
	var s seen
	select {
	case s = <-got:
	case <-time.After(90 * time.Second):
		t.Fatal("the relayed record did not reach the handler within 90 s")
	}
	if s.uuid != eventID || s.payload != `{"order":7}` || s.tenant != "acme" {
		t.Fatalf("the handler got uuid %q, payload %q, tenant %q; want %q, %q, %q", s.uuid, s.payload, s.tenant, eventID, `{"order":7}`, "acme")
	}
	if s.topic != f.topic {
		t.Fatalf("message.SubscribeTopicFromCtx = %q in a router handler reused through ib.Batch; want the source topic %q", s.topic, f.topic)
	}
	f.waitEffects(1)
	var names []string
	for _, sp := range exp.GetSpans() {
		names = append(names, sp.Name)
		if sp.Name != "process "+f.topic {
			continue
		}
		if sp.Parent.SpanID() != parent.SpanContext().SpanID() || sp.SpanContext.TraceID() != parent.SpanContext().TraceID() {
			t.Fatalf("the process span's parent is %v, want the creation span %v", sp.Parent, parent.SpanContext())
		}
		return
	}
	t.Fatalf("no span named %q; spans: %s", "process "+f.topic, fmt.Sprint(names))
}
