package relay_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// TestUnwritableTopicIsolated: 2,000 rows of a healthy topic with 50 rows of a topic that does
// not exist interleaved (their own keys). The healthy rows flow as if the missing topic were
// not there; the missing topic's rows record the broker's error and their attempts, and are
// parked after MaxAttempts refusals, visible in outbox_parked. Before, a missing topic was a
// transient error: every batch waited for the client to give up on it (2,000 rows took 37 s
// instead of 0.2 s) and its rows stayed pending forever with no attempt or error recorded.
func TestUnwritableTopicIsolated(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	good, missing := kafkatest.Topic("healthy"), kafkatest.Topic("missing")
	k := kafkatest.Fake(t, 1, kfake.SeedTopics(1, good))
	brokers := k.Brokers()

	// Interleaved: every 40 healthy rows, one row for the missing topic, in one transaction.
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	var want []written
	seq := map[string]int{}
	for round := range 50 {
		var msgs []*message.Message
		for i := range 40 {
			key := "key-" + strconv.Itoa((round*40+i)%20)
			m := outbox.SetPartitionKey(outbox.NewMessage([]byte(fmt.Sprintf("%s/%d", key, seq[key]))), key)
			m.Metadata.Set("seq", strconv.Itoa(seq[key]))
			want = append(want, written{EventID: m.UUID, Key: key, Seq: seq[key]})
			seq[key]++
			msgs = append(msgs, outbox.ToTopic(m, good))
		}
		msgs = append(msgs, outbox.ToTopic(outbox.SetPartitionKey(outbox.NewMessage([]byte("lost")), "orphan-"+strconv.Itoa(round)), missing))
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return w.WriteTx(ctx, tx, "", msgs...) }); err != nil {
			t.Fatal(err)
		}
	}
	c := newConsumer(t, brokers, good)
	rec := newRecorder()
	r := newKafkaRelayWith(t, db, relaykafka.Config{Brokers: brokers, DisableAutoTopicCreation: true},
		relay.Config{Metrics: rec, MaxAttempts: 3, RetryBackoff: 50 * time.Millisecond, MaxRetryBackoff: 200 * time.Millisecond})
	start := time.Now()
	startRelay(t, r)
	got := c.waitDistinct(t, len(want), 60*time.Second)
	healthy := time.Since(start)
	checkDelivery(t, want, got)

	// The missing topic's rows carry the broker's error while they wait, then are parked.
	eventually(t, 60*time.Second, "the missing topic's 50 rows parked", func() bool {
		var n int
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Table("outbox_parked")+` WHERE topic = $1`, missing).Scan(&n)
		return n == 50
	})
	took := time.Since(start)
	var lastErr string
	var attempts int
	if err := db.Pool.QueryRow(ctx, `SELECT last_error, attempts FROM `+db.Table("outbox_parked")+` WHERE topic = $1 LIMIT 1`, missing).Scan(&lastErr, &attempts); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(lastErr, "UNKNOWN_TOPIC_OR_PARTITION") || !strings.Contains(lastErr, missing) || attempts != 3 {
		t.Fatalf("parked row: attempts %d, last_error %q; want 3 attempts and the broker's error naming the topic", attempts, lastErr)
	}
	if n := outboxCount(t, db); n != 0 {
		t.Fatalf("%d rows still pending", n)
	}
	rec.mu.Lock()
	parked := rec.parked
	rec.mu.Unlock()
	t.Logf("2,000 healthy rows delivered in %s; the missing topic's 50 rows parked after %s (metrics: %d parked)", healthy.Round(time.Millisecond), took.Round(time.Millisecond), parked)
	if parked != 50 {
		t.Fatalf("metrics counted %d parked rows, want 50", parked)
	}
	if healthy > 20*time.Second {
		t.Fatalf("the healthy topic took %s to drain behind the missing one", healthy)
	}
}
