package inboxkafka_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
)

// bfix is one batch test's database, Kafka cluster, topic and inbox.
type bfix struct {
	t       *testing.T
	db      *testdb.DB
	brokers []string
	topic   string
	ib      *inbox.Inbox
	metrics *inbox.Counters
}

func newBatchFixture(t *testing.T, partitions int32) *bfix {
	t.Helper()
	db := testdb.New(t)
	// No unique constraint on purpose: an effect applied twice shows up as two rows. seq is
	// the message's number within its key, to check the order of each key.
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

// produced is a message the test sent: its uuid, key and number within the key.
type produced struct {
	uuid, key string
	seq       int
}

// produce sends n messages over keys keys (keys spread over the partitions), each numbered
// within its key, with the relay's record layout (UUID header, key, metadata headers).
func (f *bfix) produce(n, keys int) []produced {
	f.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(f.brokers...), kgo.DefaultProduceTopic(f.topic), kgo.AllowAutoTopicCreation())
	if err != nil {
		f.t.Fatal(err)
	}
	defer cl.Close()
	out := make([]produced, n)
	recs := make([]*kgo.Record, n)
	next := map[string]int{}
	for i := range n {
		key := "k" + strconv.Itoa(i%keys)
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

// effect is the handlers' effect: one row in the message's transaction.
func (f *bfix) effect(msg *message.Message) error {
	seq, _ := strconv.Atoi(msg.Metadata.Get("seq"))
	_, err := outbox.MustTx(msg.Context()).Exec(msg.Context(), `INSERT INTO `+f.db.Table("effect")+` (msg_uuid, k, seq) VALUES ($1, $2, $3)`,
		msg.UUID, msg.Metadata.Get("k"), seq)
	return err
}

func (f *bfix) count(sql string, args ...any) int {
	f.t.Helper()
	var n int
	if err := f.db.Pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		f.t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// start runs a batch consumer until the test ends (or the returned stop is called).
func (f *bfix) start(group string, p inbox.BatchProcessor, mod func(*inboxkafka.BatchConfig)) (stop func()) {
	f.t.Helper()
	cfg := inboxkafka.BatchConfig{Brokers: f.brokers, Group: group, Topics: []string{f.topic}, Processor: p,
		Backoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(testWriter{f.t}, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	if mod != nil {
		mod(&cfg)
	}
	c, err := inboxkafka.NewBatchConsumer(cfg)
	if err != nil {
		f.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var stopped atomic.Bool
	stop = func() {
		if stopped.Swap(true) {
			return
		}
		cancel()
		if err := <-done; err != nil {
			f.t.Errorf("Run: %v", err)
		}
	}
	f.t.Cleanup(stop)
	return stop
}

// waitEffects waits until every message has its effect (or a generous deadline passes).
func (f *bfix) waitEffects(want int) {
	f.t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		n := f.count(`SELECT count(DISTINCT msg_uuid) FROM ` + f.db.Table("effect"))
		if n >= want {
			return
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("%d of %d effects after 90 s", n, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// checkOnceInOrder fails the test unless each message's effect exists once and every key's
// effects were applied in the order its messages were produced.
func (f *bfix) checkOnceInOrder(msgs []produced) {
	f.t.Helper()
	if n := f.count(`SELECT count(*) FROM ` + f.db.Table("effect")); n != len(msgs) {
		dup := f.count(`SELECT count(*) FROM (SELECT msg_uuid FROM ` + f.db.Table("effect") + ` GROUP BY 1 HAVING count(*) > 1) d`)
		f.t.Fatalf("%d effect rows for %d messages (%d applied more than once)", n, len(msgs), dup)
	}
	if n := f.count(`SELECT count(*) FROM (SELECT seq < lag(seq) OVER (PARTITION BY k ORDER BY id) AS back FROM ` +
		f.db.Table("effect") + `) o WHERE back`); n != 0 {
		f.t.Fatalf("%d effects applied before an earlier message of their key", n)
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// Batches of 1, 100 and 1,000 messages: every message applied once, each key in order, and
// the messages redelivered to a second group member... are the same ones: a restarted
// consumer finds nothing left to apply.
func TestBatchConsumerAppliesEachMessageOnce(t *testing.T) {
	t.Parallel()
	for _, size := range []int{1, 100, 1000} {
		t.Run("batch"+strconv.Itoa(size), func(t *testing.T) {
			t.Parallel()
			f := newBatchFixture(t, 4)
			n := 3000
			if size == 1 {
				n = 600
			}
			msgs := f.produce(n, 40)
			var biggest atomic.Int64
			p := f.ib.BatchFunc("", func(ctx context.Context, tx pgx.Tx, batch []*message.Message) ([]*message.Message, error) {
				if int64(len(batch)) > biggest.Load() {
					biggest.Store(int64(len(batch)))
				}
				for _, m := range batch {
					seq, _ := strconv.Atoi(m.Metadata.Get("seq"))
					if _, err := tx.Exec(ctx, `INSERT INTO `+f.db.Table("effect")+` (msg_uuid, k, seq) VALUES ($1, $2, $3)`,
						m.UUID, m.Metadata.Get("k"), seq); err != nil {
						return nil, err
					}
				}
				return nil, nil
			})
			group := kafkatest.Topic("g")
			stop := f.start(group, p, func(c *inboxkafka.BatchConfig) { c.MaxBatch = size })
			f.waitEffects(n)
			stop()
			f.checkOnceInOrder(msgs)
			if got := biggest.Load(); got > int64(size) {
				t.Fatalf("a batch of %d messages, over MaxBatch %d", got, size)
			}
			if size > 1 && biggest.Load() < 2 {
				t.Errorf("no batch held more than one message (MaxBatch %d, %d messages waiting)", size, n)
			}
			// The offsets were committed: the same group starts after the last message, and
			// publishing the same messages again (a producer retry) changes nothing.
			if got := f.count(`SELECT count(*) FROM ` + f.db.Table("processed_event")); got != n {
				t.Fatalf("%d dedup rows, want %d", got, n)
			}
		})
	}
}

// The router's handler, unchanged, in a batch: duplicates (the same message published twice)
// are skipped, and the messages it returns are written to the outbox in the batch's
// transaction.
func TestBatchConsumerRunsRouterHandlers(t *testing.T) {
	t.Parallel()
	f := newBatchFixture(t, 2)
	msgs := f.produce(200, 10)
	cl, err := kgo.NewClient(kgo.SeedBrokers(f.brokers...), kgo.DefaultProduceTopic(f.topic))
	if err != nil {
		t.Fatal(err)
	}
	// 50 of them again, with the same UUIDs: a producer's retry.
	var again []*kgo.Record
	for _, m := range msgs[:50] {
		again = append(again, &kgo.Record{Key: []byte(m.key), Value: []byte(`{}`), Headers: []kgo.RecordHeader{
			{Key: kafka.UUIDHeaderKey, Value: []byte(m.uuid)}, {Key: "k", Value: []byte(m.key)}, {Key: "seq", Value: []byte("0")}}})
	}
	if err := cl.ProduceSync(context.Background(), again...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	cl.Close()
	p := f.ib.Batch("invoices", func(msg *message.Message) ([]*message.Message, error) {
		if err := f.effect(msg); err != nil {
			return nil, err
		}
		return []*message.Message{outbox.NewMessage([]byte(`{"invoice":"` + msg.UUID + `"}`))}, nil
	})
	f.start(kafkatest.Topic("g"), p, nil)
	deadline := time.Now().Add(90 * time.Second)
	for f.metrics.Snapshot().Processed+f.metrics.Snapshot().Duplicates < 250 {
		if time.Now().After(deadline) {
			t.Fatalf("counters %+v after 90 s", f.metrics.Snapshot())
		}
		time.Sleep(20 * time.Millisecond)
	}
	f.checkOnceInOrder(msgs)
	if s := f.metrics.Snapshot(); s.Processed != 200 || s.Duplicates != 50 {
		t.Fatalf("counters %+v, want 200 processed and 50 duplicates", s)
	}
	if n := f.count(`SELECT count(*) FROM ` + f.db.Table("outbox") + ` WHERE topic = 'invoices'`); n != 200 {
		t.Fatalf("%d outbox rows, want one per message", n)
	}
}

// A message whose handler keeps failing, in the middle of a batch: the messages before it
// commit, it is retried alone, given up after MaxAttempts (poison row and dedup row), and no
// later message of its partition is applied before it is settled. A message that fails once
// succeeds on its retry and is not poisoned. A database that refuses the batch as a whole
// poisons nothing.
func TestBatchConsumerIsolatesAPoisonMessage(t *testing.T) {
	t.Parallel()
	f := newBatchFixture(t, 1)
	msgs := f.produce(300, 5)
	bad, flaky := msgs[150].uuid, msgs[40].uuid
	index := map[string]int{}
	for i, m := range msgs {
		index[m.uuid] = i
	}
	var badTries, flakyTries atomic.Int64
	var overtook atomic.Int64
	p := f.ib.Batch("", func(msg *message.Message) ([]*message.Message, error) {
		switch msg.UUID {
		case bad:
			badTries.Add(1)
			return nil, errors.New("the handler cannot apply this message")
		case flaky:
			if flakyTries.Add(1) == 1 {
				return nil, errors.New("a transient failure")
			}
		}
		if index[msg.UUID] > 150 {
			// A message after the bad one in the partition must find it settled.
			var settled bool
			if err := outbox.MustTx(msg.Context()).QueryRow(msg.Context(), `SELECT EXISTS (SELECT 1 FROM `+f.db.Table("inbox_poison")+` WHERE message_uuid = $1)`, bad).Scan(&settled); err != nil {
				return nil, err
			}
			if !settled {
				overtook.Add(1)
			}
		}
		return nil, f.effect(msg)
	})
	f.start(kafkatest.Topic("g"), p, func(c *inboxkafka.BatchConfig) { c.MaxAttempts = 3; c.MaxBatch = 100 })
	f.waitEffects(299)
	if n := overtook.Load(); n != 0 {
		t.Fatalf("%d messages after the poison one were applied before it was settled", n)
	}
	var attempts int
	var reason, source string
	if err := f.db.Pool.QueryRow(context.Background(), `SELECT attempts, error, source FROM `+f.db.Table("inbox_poison")+` WHERE message_uuid = $1`, bad).
		Scan(&attempts, &reason, &source); err != nil {
		t.Fatalf("poison row of the bad message: %v", err)
	}
	if attempts != 3 || !strings.Contains(reason, "cannot apply") || !strings.HasPrefix(source, f.topic+"/0@") {
		t.Fatalf("poison row: attempts %d, error %q, source %q", attempts, reason, source)
	}
	if n := badTries.Load(); n != 3 {
		t.Fatalf("the bad message's handler ran %d times, want MaxAttempts = 3", n)
	}
	if n := f.count(`SELECT count(*) FROM `+f.db.Table("processed_event")+` WHERE dedup_key = $1`, "event:"+bad); n != 1 {
		t.Fatalf("the poison message has %d dedup rows, want 1 (a redelivery must be skipped)", n)
	}
	if n := f.count(`SELECT count(*) FROM ` + f.db.Table("inbox_poison")); n != 1 {
		t.Fatalf("%d poison rows, want only the bad message's", n)
	}
	if f.metrics.Snapshot().Poisoned != 1 {
		t.Fatalf("counters %+v", f.metrics.Snapshot())
	}
	var good []produced
	for _, m := range msgs {
		if m.uuid != bad {
			good = append(good, m)
		}
	}
	f.checkOnceInOrder(good)
}

// A set-based handler that fails without saying which message: the batch is halved down to
// the failing message.
func TestBatchConsumerSplitsASetHandlerDownToTheFailingMessage(t *testing.T) {
	t.Parallel()
	f := newBatchFixture(t, 1)
	msgs := f.produce(64, 4)
	bad := msgs[37].uuid
	var calls atomic.Int64
	p := f.ib.BatchFunc("", func(ctx context.Context, tx pgx.Tx, batch []*message.Message) ([]*message.Message, error) {
		calls.Add(1)
		for _, m := range batch {
			if m.UUID == bad {
				return nil, errors.New("one of these is bad")
			}
			seq, _ := strconv.Atoi(m.Metadata.Get("seq"))
			if _, err := tx.Exec(ctx, `INSERT INTO `+f.db.Table("effect")+` (msg_uuid, k, seq) VALUES ($1, $2, $3)`, m.UUID, m.Metadata.Get("k"), seq); err != nil {
				return nil, err
			}
		}
		return nil, nil
	})
	f.start(kafkatest.Topic("g"), p, func(c *inboxkafka.BatchConfig) { c.MaxAttempts = 2 })
	f.waitEffects(63)
	waitPoison(t, f, bad)
	var good []produced
	for _, m := range msgs {
		if m.uuid != bad {
			good = append(good, m)
		}
	}
	f.checkOnceInOrder(good)
	t.Logf("%d handler calls for 64 messages and one bad one", calls.Load())
}

func waitPoison(t *testing.T, f *bfix, uuid string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for f.count(`SELECT count(*) FROM `+f.db.Table("inbox_poison")+` WHERE message_uuid = $1`, uuid) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("message %s not recorded as poison", uuid)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A database that refuses every batch for a while (here: the effect table is missing, as
// during a deploy that migrates late): nothing is poisoned, nothing skipped; once it is
// back, every message is applied once.
func TestBatchConsumerRetriesARefusedBatchWithoutPoisoning(t *testing.T) {
	t.Parallel()
	f := newBatchFixture(t, 1)
	msgs := f.produce(50, 5)
	var down atomic.Bool
	down.Store(true)
	var refusals atomic.Int64
	p := f.ib.Batch("", func(msg *message.Message) ([]*message.Message, error) {
		return nil, f.effect(msg)
	})
	failing := refusingProcessor{BatchProcessor: p, down: &down, refusals: &refusals}
	f.start(kafkatest.Topic("g"), failing, func(c *inboxkafka.BatchConfig) { c.MaxAttempts = 1 })
	deadline := time.Now().Add(60 * time.Second)
	for refusals.Load() < 5 {
		if time.Now().After(deadline) {
			t.Fatal("the consumer did not retry the refused batch")
		}
		time.Sleep(10 * time.Millisecond)
	}
	down.Store(false)
	f.waitEffects(50)
	f.checkOnceInOrder(msgs)
	if n := f.count(`SELECT count(*) FROM ` + f.db.Table("inbox_poison")); n != 0 {
		t.Fatalf("%d messages poisoned by a database outage", n)
	}
}

// refusingProcessor fails whole batches, as an unreachable database does, while down is set.
type refusingProcessor struct {
	inbox.BatchProcessor
	down     *atomic.Bool
	refusals *atomic.Int64
}

func (r refusingProcessor) ProcessBatch(ctx context.Context, msgs []*message.Message) error {
	if r.down.Load() {
		r.refusals.Add(1)
		return fmt.Errorf("connect: %w", errors.New("connection refused"))
	}
	return r.BatchProcessor.ProcessBatch(ctx, msgs)
}

func TestBatchConfigReportsEveryProblem(t *testing.T) {
	_, err := inboxkafka.NewBatchConsumer(inboxkafka.BatchConfig{MaxBatch: -1, Workers: -2, MaxAttempts: -1})
	if err == nil {
		t.Fatal("no error")
	}
	for _, want := range []string{"Brokers is empty", "Group is empty", "Topics is empty", "Processor is nil", "MaxBatch is -1", "Workers is -2", "MaxAttempts is -1"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
}

// A handler failing with a deadlock (a transient database error) more often than
// MaxAttempts: the batch is retried without counting attempts, and the message is applied,
// not poisoned.
func TestBatchConsumerDoesNotPoisonOnTransientErrors(t *testing.T) {
	t.Parallel()
	f := newBatchFixture(t, 1)
	msgs := f.produce(20, 2)
	var deadlocks atomic.Int64
	p := f.ib.Batch("", func(msg *message.Message) ([]*message.Message, error) {
		if msg.UUID == msgs[7].uuid && deadlocks.Add(1) <= 4 {
			return nil, fmt.Errorf("update ledger: %w", &pgconn.PgError{Code: "40P01", Message: "deadlock detected"})
		}
		return nil, f.effect(msg)
	})
	f.start(kafkatest.Topic("g"), p, func(c *inboxkafka.BatchConfig) { c.MaxAttempts = 2 })
	f.waitEffects(20)
	f.checkOnceInOrder(msgs)
	if n := f.count(`SELECT count(*) FROM ` + f.db.Table("inbox_poison")); n != 0 {
		t.Fatalf("%d messages poisoned by deadlocks", n)
	}
}

// On a schema without the migrations, Run fails at once with an error that says what to run,
// instead of retrying every batch forever.
func TestBatchConsumerRefusesAnUnmigratedSchema(t *testing.T) {
	t.Parallel()
	db := testdb.NewEmpty(t)
	ib, err := inbox.New(inbox.Config{Pool: db.Pool, Schema: db.Schema, Consumer: "batch"})
	if err != nil {
		t.Fatal(err)
	}
	c, err := inboxkafka.NewBatchConsumer(inboxkafka.BatchConfig{Brokers: kafkatest.Brokers(t, 1), Group: kafkatest.Topic("g"),
		Topics: []string{kafkatest.Topic("t")}, Processor: ib.BatchNoPublish(func(*message.Message) error { return nil })})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = c.Run(ctx)
	if !errors.Is(err, migrations.ErrNotMigrated) || !strings.Contains(err.Error(), "onceflow migrate up") {
		t.Fatalf("Run on an unmigrated schema: %v; want migrations.ErrNotMigrated naming the command", err)
	}
}

// A handler that returns a message the outbox cannot take (no topic) fails its own message,
// not the batch: that message is given up at once (no retry can fix it), the others commit.
func TestBatchConsumerPoisonsAMessageWhoseOutputIsRefused(t *testing.T) {
	t.Parallel()
	f := newBatchFixture(t, 1)
	msgs := f.produce(30, 3)
	bad := msgs[12].uuid
	var badTries atomic.Int64
	p := f.ib.Batch("", func(msg *message.Message) ([]*message.Message, error) {
		if err := f.effect(msg); err != nil {
			return nil, err
		}
		out := outbox.NewMessage([]byte(`{}`))
		if msg.UUID == bad {
			badTries.Add(1)
			return []*message.Message{out}, nil // no topic: neither ToTopic nor a publish topic
		}
		return []*message.Message{outbox.ToTopic(out, "audit")}, nil
	})
	f.start(kafkatest.Topic("g"), p, nil)
	waitPoison(t, f, bad)
	f.waitEffects(29)
	if n := badTries.Load(); n != 1 {
		t.Fatalf("the refused message's handler ran %d times; want once (poison, no retry)", n)
	}
	var good []produced
	for _, m := range msgs {
		if m.uuid != bad {
			good = append(good, m)
		}
	}
	f.checkOnceInOrder(good)
	if n := f.count(`SELECT count(*) FROM ` + f.db.Table("outbox") + ` WHERE topic = 'audit'`); n != 29 {
		t.Fatalf("%d outbox rows, want one per applied message", n)
	}
}
