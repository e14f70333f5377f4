package relay_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// TestLateCommitsBelowTheCursorAreDelivered: the relay claims from a cursor (the last id it
// handled), so rows whose transactions commit after later ids were published sit below it.
// Held-open transactions commit out of id order — a single keyless row, a keyed transaction,
// one with more rows than a batch, one whose id was taken before the transaction had a
// transaction id (the order in which PostgreSQL evaluates a column default and assigns the
// id), one rolled back — while other transactions keep committing; every committed row must
// reach Kafka, in key order, and the rolled-back one never. With one relay, and with two
// sharing the shards.
func TestLateCommitsBelowTheCursorAreDelivered(t *testing.T) {
	t.Parallel()
	for _, relays := range []int{1, 2} {
		t.Run(strconv.Itoa(relays)+" relays", func(t *testing.T) {
			t.Parallel()
			testLateCommits(t, relays)
		})
	}
}

func testLateCommits(t *testing.T, relays int) {
	ctx := context.Background()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 4)
	topic := kafkatest.Topic("late")
	c := newConsumer(t, brokers, topic)
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	for i := range relays {
		// Small batches: the cursor moves in many steps, and the big late transaction takes
		// several batches.
		cfg := relay.Config{BatchSize: 7, PollInterval: 50 * time.Millisecond, InstanceID: fmt.Sprintf("late-%d", i), LeaseDuration: 2 * time.Second}
		if i == 0 {
			cfg.Metrics = rec
		}
		startRelay(t, newKafkaRelay(t, db, brokers, cfg))
	}
	rec.waitFor(t, 30*time.Second, "shards owned", func(r *recorder) bool { return r.owned > 0 })
	if relays > 1 {
		rec.waitFor(t, 30*time.Second, "shards shared", func(r *recorder) bool { return r.owned == 32 })
	}

	var want []written
	// events builds n messages of key (payload "<key>/<seq>", as checkDelivery expects).
	events := func(key string, n int) ([]*message.Message, []written) {
		var msgs []*message.Message
		var ws []written
		for s := range n {
			m := outbox.SetPartitionKey(outbox.NewMessage(fmt.Appendf(nil, "%s/%d", key, s)), key)
			msgs = append(msgs, m)
			ws = append(ws, written{EventID: m.UUID, Key: key, Seq: s})
		}
		return msgs, ws
	}
	hold := func(key string, n int) (pgx.Tx, []written) {
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tx.Rollback(ctx) }) // no-op once committed
		msgs, ws := events(key, n)
		if err := w.WriteTx(ctx, tx, topic, msgs...); err != nil {
			t.Fatal(err)
		}
		return tx, ws
	}
	flow := func(round, n int) {
		for i := range n {
			msgs, ws := events(fmt.Sprintf("flow-%d-%d", round, i), 3)
			if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return w.WriteTx(ctx, tx, topic, msgs...) }); err != nil {
				t.Fatal(err)
			}
			want = append(want, ws...)
		}
		c.waitDistinct(t, len(want), 60*time.Second) // published: the cursor is past the held rows
	}
	commit := func(tx pgx.Tx, ws []written) {
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		want = append(want, ws...)
	}

	single, singleW := hold("single", 1)
	keyed, keyedW := hold("keyed", 3)
	big, bigW := hold("big", 40)
	rolled, rolledW := hold("rolled-back", 2)
	// An id taken before its transaction has a transaction id: nextval assigns none, the row
	// is inserted with that id only later.
	anomaly, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = anomaly.Rollback(ctx) })
	var anomalyID int64
	if err := anomaly.QueryRow(ctx, `SELECT nextval(pg_get_serial_sequence($1, 'id'))`, db.Schema+".outbox").Scan(&anomalyID); err != nil {
		t.Fatal(err)
	}

	flow(1, 30)
	commit(single, singleW)
	c.waitDistinct(t, len(want), 60*time.Second)

	flow(2, 10)
	commit(keyed, keyedW)
	commit(big, bigW)
	if err := rolled.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	flow(3, 10)

	am, aw := events("anomaly", 1)
	if _, err := anomaly.Exec(ctx, `INSERT INTO `+db.Schema+`.outbox (id, event_id, topic, partition_key, key_hash, payload, metadata)
		OVERRIDING SYSTEM VALUE VALUES ($1, $2, $3, $4, 12345, $5, '{"partition_key":"anomaly"}')`,
		anomalyID, am[0].UUID, topic, "anomaly", am[0].Payload); err != nil {
		t.Fatal(err)
	}
	commit(anomaly, aw)
	flow(4, 5)

	got := c.waitDistinct(t, len(want), 60*time.Second)
	checkDelivery(t, want, got)
	for _, r := range got {
		for _, rw := range rolledW {
			if r.EventID == rw.EventID {
				t.Fatalf("rolled-back event %s was published", rw.EventID)
			}
		}
	}
	eventually(t, 30*time.Second, "empty outbox", func() bool {
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Schema+`.outbox`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
}
