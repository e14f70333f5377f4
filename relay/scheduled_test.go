package relay_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// arrival is one record as a scheduled test sees it: its timestamp is when the relay's
// producer took it (the publish time, in milliseconds; the topic is created by the first
// publish, so when the test's consumer reads it says little).
type arrival struct {
	rec *kgo.Record
}

// arrivals reads topic from the start and records each event id's first arrival.
type arrivals struct {
	mu   sync.Mutex
	byID map[string]arrival
	n    map[string]int // deliveries per event id
}

func readArrivals(t *testing.T, brokers []string, topic string) *arrivals {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	a := &arrivals{byID: map[string]arrival{}, n: map[string]int{}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			fs := cl.PollFetches(ctx)
			fs.EachRecord(func(r *kgo.Record) {
				id := ""
				for _, h := range r.Headers {
					if h.Key == "_watermill_message_uuid" {
						id = string(h.Value)
					}
				}
				a.mu.Lock()
				if _, ok := a.byID[id]; !ok {
					a.byID[id] = arrival{rec: r}
				}
				a.n[id]++
				a.mu.Unlock()
			})
		}
	}()
	t.Cleanup(func() { cancel(); <-done; cl.Close() })
	return a
}

func (a *arrivals) get(id string) (arrival, int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.byID[id], a.n[id]
}

func (a *arrivals) count() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.byID)
}

// dueMsg is a scheduled message the test wrote: it may not be published before notBefore, and
// must be within a second after dueBy (the two differ for DeliverAfter, whose due time is the
// writing transaction's start on the database's clock).
type dueMsg struct {
	id               string
	key              string
	notBefore, dueBy time.Time
}

// writeScheduled writes, per transaction, immediate messages and scheduled ones in one call.
func writeScheduled(t *testing.T, db *testdb.DB, topic string, immediate int, delays []time.Duration, after bool, key func(i int) string) []dueMsg {
	t.Helper()
	ctx := context.Background()
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	var msgs []*message.Message
	for i := range immediate {
		msgs = append(msgs, outbox.SetPartitionKey(outbox.NewMessage([]byte(fmt.Sprintf("now-%d", i))), fmt.Sprintf("k%d", i%7)))
	}
	start := time.Now()
	var out []dueMsg
	for i, d := range delays {
		m := outbox.NewMessage([]byte(fmt.Sprintf("later-%d", i)))
		k := key(i)
		if k != "" {
			outbox.SetPartitionKey(m, k)
		}
		if after {
			outbox.DeliverAfter(m, d)
		} else {
			outbox.DeliverAt(m, start.Add(d))
		}
		msgs = append(msgs, m)
		out = append(out, dueMsg{id: m.UUID, key: k, notBefore: start.Add(d)})
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return w.WriteTx(ctx, tx, topic, msgs...) }); err != nil {
		t.Fatal(err)
	}
	end := time.Now()
	for i := range out {
		out[i].dueBy = out[i].notBefore
		if after {
			out[i].dueBy = end.Add(delays[i])
			// The transaction began after start: its now() is at or after it.
		}
	}
	return out
}

// TestScheduledMessagesPublishOnTime: with two relays running, scheduled messages due over a
// few seconds, written among immediate ones in the same calls, are each published once, none before its time (by the
// record's produce timestamp) and each published (the record's timestamp) within 1s after it; a key's scheduled
// messages come out in due order whatever order they were written in; a message cancelled
// before its time is never published (CancelTx reports true), and cancelling one already
// published reports false.
func TestScheduledMessagesPublishOnTime(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 3)
	topic := kafkatest.Topic("scheduled")
	got := readArrivals(t, brokers, topic)
	// Two relays: both check and move; per-key due order must hold across them.
	startRelay(t, newKafkaRelay(t, db, brokers, relay.Config{InstanceID: "sched-a"}))
	startRelay(t, newKafkaRelay(t, db, brokers, relay.Config{InstanceID: "sched-b"}))

	var due []dueMsg
	var delays []time.Duration
	for i := range 30 {
		delays = append(delays, 300*time.Millisecond+time.Duration(i)*110*time.Millisecond)
	}
	due = append(due, writeScheduled(t, db, topic, 100, delays, false, func(i int) string { return fmt.Sprintf("k%d", i%7) })...)
	due = append(due, writeScheduled(t, db, topic, 100, delays, true, func(i int) string {
		if i%3 == 0 {
			return ""
		}
		return fmt.Sprintf("k%d", i%5)
	})...)
	// One key written in reverse due order: published in due order.
	rev := []time.Duration{2500 * time.Millisecond, 2000 * time.Millisecond, 1500 * time.Millisecond, 1000 * time.Millisecond}
	ordered := writeScheduled(t, db, topic, 0, rev, false, func(int) string { return "reversed" })
	due = append(due, ordered...)

	// Cancelled before due: never published.
	w, _ := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	cancelled := writeScheduled(t, db, topic, 0, []time.Duration{1500 * time.Millisecond, 1500 * time.Millisecond}, true, func(int) string { return "c" })
	var ok bool
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) (err error) {
		ok, err = w.CancelTx(ctx, tx, cancelled[0].id)
		return err
	}); err != nil || !ok {
		t.Fatalf("cancel before due: cancelled=%v err=%v, want true", ok, err)
	}
	// A cancel that rolls back cancels nothing: its message is published.
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		if ok, err := w.CancelTx(ctx, tx, cancelled[1].id); err != nil || !ok {
			t.Errorf("cancel (rolled back): cancelled=%v err=%v", ok, err)
		}
		return fmt.Errorf("roll back")
	}); err == nil {
		t.Fatal("rolled back transaction reported no error")
	}
	due = append(due, cancelled[1])

	total := 200 + len(due)
	eventually(t, 20*time.Second, "every message published", func() bool { return got.count() >= total })
	for _, d := range due {
		a, n := got.get(d.id)
		if n != 1 {
			t.Errorf("%s published %d times", d.id, n)
		}
		if a.rec.Timestamp.Before(d.notBefore.Truncate(time.Millisecond)) { // Kafka timestamps are milliseconds
			t.Errorf("%s produced at %s, %s before its time", d.id, a.rec.Timestamp.Format(time.StampMicro), d.notBefore.Sub(a.rec.Timestamp))
		}
		if late := a.rec.Timestamp.Sub(d.dueBy); late > time.Second {
			t.Errorf("%s published %s after its time, want within 1s", d.id, late)
		}
	}
	for i := 1; i < len(ordered); i++ {
		// Written in reverse due order: due order is the reverse of ordered.
		prev, _ := got.get(ordered[i].id)
		cur, _ := got.get(ordered[i-1].id)
		if prev.rec.Partition != cur.rec.Partition || prev.rec.Offset > cur.rec.Offset {
			t.Errorf("key %q: due order broken at %d", ordered[i].key, i)
		}
	}
	if _, n := got.get(cancelled[0].id); n != 0 {
		t.Errorf("cancelled message published %d times", n)
	}
	// Too late: already moved and published.
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) (err error) {
		ok, err = w.CancelTx(ctx, tx, due[0].id)
		return err
	}); err != nil || ok {
		t.Fatalf("cancel after publish: cancelled=%v err=%v, want false", ok, err)
	}
	eventually(t, 10*time.Second, "empty outbox", func() bool { return outboxCount(t, db) == 0 })
	if n := scheduledCount(t, db); n != 0 {
		t.Fatalf("%d scheduled rows left", n)
	}
	// Wait past the cancelled message's time, with a margin: nothing more arrives.
	time.Sleep(time.Until(cancelled[0].dueBy.Add(500 * time.Millisecond)))
	if _, n := got.get(cancelled[0].id); n != 0 {
		t.Errorf("cancelled message published %d times", n)
	}
}

// TestScheduledMessagesSurviveRelayRestart: a relay stopped while scheduled messages fall due,
// and another started after some of them are overdue: every message is published, the
// overdue ones at once.
func TestScheduledMessagesSurviveRelayRestart(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 2)
	topic := kafkatest.Topic("scheduled-restart")
	got := readArrivals(t, brokers, topic)
	var delays []time.Duration
	for i := range 40 {
		delays = append(delays, 200*time.Millisecond+time.Duration(i)*75*time.Millisecond)
	}
	due := writeScheduled(t, db, topic, 50, delays, false, func(i int) string { return fmt.Sprintf("k%d", i%4) })
	stop := startRelay(t, newKafkaRelay(t, db, brokers, relay.Config{}))
	eventually(t, 10*time.Second, "some scheduled messages published", func() bool { return got.count() >= 50+10 })
	stop()
	time.Sleep(700 * time.Millisecond) // some fall due while no relay runs
	restarted := time.Now()
	startRelay(t, newKafkaRelay(t, db, brokers, relay.Config{}))
	eventually(t, 20*time.Second, "every message published", func() bool { return got.count() >= 50+len(due) })
	for _, d := range due {
		a, _ := got.get(d.id)
		if a.rec.Timestamp.Before(d.notBefore.Truncate(time.Millisecond)) { // Kafka timestamps are milliseconds
			t.Errorf("%s produced %s before its time", d.id, d.notBefore.Sub(a.rec.Timestamp))
		}
		if late := a.rec.Timestamp.Sub(later(d.dueBy, restarted)); late > time.Second {
			t.Errorf("%s published %s after its time (or the restart), want within 1s", d.id, late)
		}
	}
	if n := scheduledCount(t, db); n != 0 {
		t.Fatalf("%d scheduled rows left", n)
	}
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

func scheduledCount(t testing.TB, db *testdb.DB) int {
	t.Helper()
	var n int
	if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+db.Table("outbox_scheduled")).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestScheduledWakesSleepingRelay: a sleeping relay (idle, waiting for NOTIFY) publishes a
// message due soon (its write notifies) and one due later than outbox.ScheduledWakeWithin
// (its write does not notify: the sleeping relay's slow check finds it before its time), each
// within 1s of its time.
func TestScheduledWakesSleepingRelay(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 1)
	topic := kafkatest.Topic("scheduled-sleep")
	got := readArrivals(t, brokers, topic)
	startRelay(t, newKafkaRelay(t, db, brokers, relay.Config{}))
	eventually(t, 30*time.Second, "the relay to sleep", func() bool { return asleep(t, db) })
	time.Sleep(time.Second) // past the relay's grace of tight polls: a steady sleep, not an event
	due := writeScheduled(t, db, topic, 0, []time.Duration{800 * time.Millisecond}, true, func(int) string { return "soon" })
	due = append(due, writeScheduled(t, db, topic, 0, []time.Duration{outbox.ScheduledWakeWithin + 700*time.Millisecond}, true, func(int) string { return "later" })...)
	eventually(t, 20*time.Second, "both published", func() bool { return got.count() >= 2 })
	for _, d := range due {
		a, n := got.get(d.id)
		if n != 1 {
			t.Errorf("%s published %d times", d.key, n)
		}
		if a.rec.Timestamp.Before(d.notBefore.Truncate(time.Millisecond)) {
			t.Errorf("%s produced %s before its time", d.key, d.notBefore.Sub(a.rec.Timestamp))
		}
		if late := a.rec.Timestamp.Sub(d.dueBy); late > time.Second {
			t.Errorf("%s published %s after its time, want within 1s", d.key, late)
		}
	}
}
