package relay_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// writeOne writes one event with the given key and payload in its own transaction.
func writeOne(t testing.TB, db *testdb.DB, topic, key string, payload []byte) *message.Message {
	t.Helper()
	ctx := context.Background()
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	m := outbox.NewMessage(payload)
	if key != "" {
		outbox.SetPartitionKey(m, key)
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return w.WriteTx(ctx, tx, topic, m) }); err != nil {
		t.Fatal(err)
	}
	return m
}

func rowAttempts(t testing.TB, db *testdb.DB, eventID string) (attempts int, lastError string) {
	t.Helper()
	err := db.Pool.QueryRow(context.Background(), `SELECT attempts, coalesce(last_error, '') FROM `+db.Table("outbox")+` WHERE event_id = $1`, eventID).Scan(&attempts, &lastError)
	if err != nil {
		t.Fatalf("read attempts of %s: %v", eventID, err)
	}
	return attempts, lastError
}

func keyOrder(recs []consumed, key string) []string {
	var ids []string
	seen := map[string]bool{}
	for _, r := range recs {
		if r.Key == key && !seen[r.EventID] {
			seen[r.EventID] = true
			ids = append(ids, r.EventID)
		}
	}
	return ids
}

// TestParkingAndReplay: a row the broker refuses permanently (larger than the topic's
// max.message.bytes) blocks only its own key: other keys, and rows written after it, keep
// flowing while it is retried; rows of its key wait behind it. At the attempt limit it is
// parked with its error, and the rest of its key flows. Once the topic accepts it, replay
// publishes it with its original event id.
func TestParkingAndReplay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	k := kafkatest.Fake(t, 1, kfake.BrokerConfigs(map[string]string{"message.max.bytes": "65536"}))
	brokers := k.Brokers()
	topic := kafkatest.Topic("park")

	a1 := writeOne(t, db, topic, "A", []byte("a1"))
	var bs []*message.Message
	for i := range 5 {
		bs = append(bs, writeOne(t, db, topic, "B", []byte(fmt.Sprintf("b%d", i))))
	}
	noise := make([]byte, 100_000)
	_, _ = rand.Read(noise) // incompressible: the producer compresses batches
	poison := writeOne(t, db, topic, "A", noise)
	for i := 5; i < 10; i++ {
		bs = append(bs, writeOne(t, db, topic, "B", []byte(fmt.Sprintf("b%d", i))))
	}
	a3 := writeOne(t, db, topic, "A", []byte("a3"))
	free := writeOne(t, db, topic, "", []byte("no key"))
	c := newConsumer(t, brokers, topic)

	// Phase 1: a high limit, so the poison row keeps failing.
	cfg := relay.Config{BatchSize: 50, MaxAttempts: 1000, RetryBackoff: 20 * time.Millisecond, MaxRetryBackoff: 100 * time.Millisecond}
	stop := startRelay(t, newKafkaRelay(t, db, brokers, cfg))
	c.waitDistinct(t, 1+len(bs)+1, 60*time.Second) // a1, every B, the keyless row
	eventually(t, 60*time.Second, "the poison row to be retried", func() bool { n, _ := rowAttempts(t, db, poison.UUID); return n >= 3 })
	stop()
	attempts, lastErr := rowAttempts(t, db, poison.UUID)
	if !strings.Contains(lastErr, "MESSAGE_TOO_LARGE") {
		t.Fatalf("last_error = %q, want the broker's MESSAGE_TOO_LARGE", lastErr)
	}
	got := c.snapshot()
	if ids := keyOrder(got, "B"); len(ids) != len(bs) {
		t.Fatalf("key B: %d of %d events delivered while key A was blocked", len(ids), len(bs))
	}
	if ids := keyOrder(got, "A"); len(ids) != 1 || ids[0] != a1.UUID {
		t.Fatalf("key A delivered %v; want only a1 (a3 must wait behind the failing row)", ids)
	}
	if ids := keyOrder(got, ""); len(ids) != 1 || ids[0] != free.UUID {
		t.Fatalf("keyless rows delivered %v, want %s", ids, free.UUID)
	}

	// Phase 2: the next refusal reaches the limit, the row is parked and a3 flows.
	cfg.MaxAttempts = attempts + 1
	stop = startRelay(t, newKafkaRelay(t, db, brokers, cfg))
	c.waitDistinct(t, 1+len(bs)+1+1, 60*time.Second)
	eventually(t, 30*time.Second, "empty outbox", func() bool { return outboxCount(t, db) == 0 })
	stop()
	if ids := keyOrder(c.snapshot(), "A"); len(ids) != 2 || ids[1] != a3.UUID {
		t.Fatalf("key A after parking: %v, want a1 then a3", ids)
	}
	admin, err := relay.NewAdmin(db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	parked, err := admin.Parked(ctx, db.Pool, relay.ParkedFilter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(parked) != 1 || parked[0].EventID != poison.UUID || parked[0].Attempts != cfg.MaxAttempts ||
		parked[0].Key != "A" || parked[0].Size != 100_000 || !strings.Contains(parked[0].LastError, "MESSAGE_TOO_LARGE") {
		t.Fatalf("parked = %+v; want the poison row with %d attempts and its error", parked, cfg.MaxAttempts)
	}

	// Replay after the topic was fixed: same event id, delivered after a3 (order broken by
	// design once a row is parked).
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	alter := kmsg.NewPtrIncrementalAlterConfigsRequest()
	res := kmsg.NewIncrementalAlterConfigsRequestResource()
	res.ResourceType, res.ResourceName = kmsg.ConfigResourceTypeTopic, topic
	cv := kmsg.NewIncrementalAlterConfigsRequestResourceConfig()
	cv.Name, cv.Value = "max.message.bytes", kmsg.StringPtr("2000000")
	res.Configs = append(res.Configs, cv)
	alter.Resources = append(alter.Resources, res)
	resp, err := alter.RequestWith(ctx, cl)
	if err != nil || resp.Resources[0].ErrorCode != 0 {
		t.Fatalf("raise max.message.bytes: %v %+v", err, resp)
	}
	var replayed []relay.Replayed
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		var err error
		replayed, err = admin.ReplayTx(ctx, tx, relay.ParkedFilter{EventIDs: []string{poison.UUID}})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if len(replayed) != 1 || replayed[0].EventID != poison.UUID {
		t.Fatalf("replayed %+v", replayed)
	}
	startRelay(t, newKafkaRelay(t, db, brokers, cfg))
	got = c.waitDistinct(t, 1+len(bs)+1+2, 60*time.Second)
	if ids := keyOrder(got, "A"); len(ids) != 3 || ids[2] != poison.UUID {
		t.Fatalf("key A after replay: %v, want a1, a3, then the replayed row %s", ids, poison.UUID)
	}
	for _, r := range got {
		if r.EventID == poison.UUID && len(r.Value) != 100_000 {
			t.Fatalf("replayed payload is %d bytes", len(r.Value))
		}
	}
	if left, _ := admin.Parked(ctx, db.Pool, relay.ParkedFilter{}); len(left) != 0 {
		t.Fatalf("parked rows left after replay: %+v", left)
	}
}

// TestOversizedRowRefusedBeforeSending: a row larger than the sink's MaxMessageBytes is refused
// client-side (never sent, so it cannot fail alone inside the producer while later rows of its
// key go out), counted, and parked at the limit; its key's later rows wait until then.
func TestOversizedRowRefusedBeforeSending(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	k := kafkatest.Fake(t, 1)
	brokers := k.Brokers()
	topic := kafkatest.Topic("oversize")
	var largest atomic.Int64 // observed, never answered: every request is handled normally
	k.Cluster.ControlKey(int16(kmsg.Produce), func(r kmsg.Request) (kmsg.Response, error, bool) {
		k.Cluster.KeepControl()
		for _, rt := range r.(*kmsg.ProduceRequest).Topics {
			for _, rp := range rt.Partitions {
				if n := int64(len(rp.Records)); n > largest.Load() {
					largest.Store(n)
				}
			}
		}
		return nil, nil, false
	})
	bigPayload := make([]byte, 5000)
	_, _ = rand.Read(bigPayload) // incompressible, so the request size would show it
	big := writeOne(t, db, topic, "K", bigPayload)
	after := writeOne(t, db, topic, "K", []byte("after"))
	other := writeOne(t, db, topic, "L", []byte("other"))
	c := newConsumer(t, brokers, topic)
	cfg := relay.Config{MaxAttempts: 3, RetryBackoff: 10 * time.Millisecond, MaxRetryBackoff: 50 * time.Millisecond}
	startRelay(t, newKafkaRelayWith(t, db, relaykafka.Config{Brokers: brokers, MaxMessageBytes: 4096}, cfg))
	got := c.waitDistinct(t, 2, 60*time.Second)
	eventually(t, 30*time.Second, "empty outbox", func() bool { return outboxCount(t, db) == 0 })
	if ids := keyOrder(got, "K"); len(ids) != 1 || ids[0] != after.UUID {
		t.Fatalf("key K delivered %v, want only the row after the oversized one", ids)
	}
	if ids := keyOrder(got, "L"); len(ids) != 1 || ids[0] != other.UUID {
		t.Fatalf("key L delivered %v", ids)
	}
	var attempts int
	var lastErr string
	if err := db.Pool.QueryRow(ctx, `SELECT attempts, last_error FROM `+db.Table("outbox_parked")+` WHERE event_id = $1`, big.UUID).Scan(&attempts, &lastErr); err != nil {
		t.Fatalf("oversized row not parked: %v", err)
	}
	if attempts != 3 || !strings.Contains(lastErr, relaykafka.ErrMessageTooLarge.Error()) || !strings.Contains(lastErr, "4096") {
		t.Fatalf("parked with attempts %d, error %q", attempts, lastErr)
	}
	if n := largest.Load(); n >= 5000 {
		t.Fatalf("a produce request carried %d bytes of records: the oversized row was sent", n)
	}
}
