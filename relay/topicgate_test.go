package relay_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
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

	want := writeInterleaved(t, db, good, missing)
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

// writeInterleaved writes 2,000 rows of topic good (20 keys) with one row of topic missing
// (a key of its own) after every 40, in 50 transactions, and returns the good rows.
func writeInterleaved(t testing.TB, db *testdb.DB, good, missing string) []written {
	t.Helper()
	ctx := context.Background()
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
	return want
}

// firstRefusal is a recorder that also notes when the relay first counted an undeliverable
// refusal.
type firstRefusal struct {
	*recorder
	mu sync.Mutex
	at time.Time
}

func (f *firstRefusal) Failed(kind relay.FailureKind, n int) {
	if kind == relay.FailureUndeliverable {
		f.mu.Lock()
		if f.at.IsZero() {
			f.at = time.Now()
		}
		f.mu.Unlock()
	}
	f.recorder.Failed(kind, n)
}

// parkingBound is the documented bound on how long after its topic's first refusal a row of
// a topic refused as a whole, pending at that refusal, is parked (docs/relay.md, "Topics"):
// MaxAttempts−1 waits for the topic's reopening, each at most 1.25× the nominal backoff,
// not counting the time the sends themselves take.
func parkingBound(cfg relay.Config) time.Duration {
	var sum time.Duration
	d := cfg.RetryBackoff
	for range cfg.MaxAttempts - 1 {
		sum += min(d, cfg.MaxRetryBackoff)
		d *= 2
	}
	return sum + sum/4
}

// TestUnwritableTopicParkedWithinBound: the interleaving of TestUnwritableTopicIsolated, where
// the first batch's refusal closes the missing topic while the second batch still holds half
// of its rows. Every one of the 50 rows must be parked within the documented bound after the
// topic's first refusal, with MaxAttempts attempts. Before, the rows claimed while the topic
// was closed counted no attempt and rows retried on backoffs of their own missed reopenings,
// each falling a whole backoff behind: some rows took 1.4× as long as others, and longer
// than the documented time.
func TestUnwritableTopicParkedWithinBound(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	good, missing := kafkatest.Topic("healthy"), kafkatest.Topic("missing")
	k := kafkatest.Fake(t, 1, kfake.SeedTopics(1, good))
	want := writeInterleaved(t, db, good, missing)
	c := newConsumer(t, k.Brokers(), good)
	rec := &firstRefusal{recorder: newRecorder()}
	cfg := relay.Config{Metrics: rec, MaxAttempts: 5, RetryBackoff: 400 * time.Millisecond, MaxRetryBackoff: 1600 * time.Millisecond}
	startRelay(t, newKafkaRelayWith(t, db, relaykafka.Config{Brokers: k.Brokers(), DisableAutoTopicCreation: true}, cfg))
	checkDelivery(t, want, c.waitDistinct(t, len(want), 60*time.Second))
	eventually(t, 60*time.Second, "the missing topic's 50 rows parked", func() bool {
		var n int
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Table("outbox_parked")+` WHERE topic = $1`, missing).Scan(&n)
		return n == 50
	})
	rec.mu.Lock()
	first := rec.at
	rec.mu.Unlock()

	rows, err := db.Pool.Query(ctx, `SELECT id, attempts, extract(epoch FROM parked_at)::float8 FROM `+db.Table("outbox_parked")+` WHERE topic = $1 ORDER BY id`, missing)
	if err != nil {
		t.Fatal(err)
	}
	type parkedRow struct {
		id       int64
		attempts int
		after    time.Duration // parked this long after the topic's first refusal
	}
	parked, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (parkedRow, error) {
		var p parkedRow
		var at float64
		err := row.Scan(&p.id, &p.attempts, &at)
		p.after = time.Unix(0, int64(at*1e9)).Sub(first)
		return p, err
	})
	if err != nil {
		t.Fatal(err)
	}
	// The sends themselves take time too (franz-go retries an unknown topic's metadata a few
	// times before it gives up): allow each attempt a generous share.
	perAttempt := 500 * time.Millisecond
	if raceEnabled {
		perAttempt = time.Second
	}
	bound := parkingBound(cfg) + time.Duration(cfg.MaxAttempts)*perAttempt
	lo, hi := parked[0].after, parked[0].after
	for _, p := range parked {
		lo, hi = min(lo, p.after), max(hi, p.after)
		if p.attempts != cfg.MaxAttempts {
			t.Errorf("row %d parked after %d attempts, want %d", p.id, p.attempts, cfg.MaxAttempts)
		}
	}
	t.Logf("the missing topic's rows parked %s to %s after its first refusal (bound %s: %s of backoffs and %s per attempt)",
		lo.Round(time.Millisecond), hi.Round(time.Millisecond), bound, parkingBound(cfg), perAttempt)
	for _, p := range parked {
		if p.after > bound {
			t.Errorf("row %d parked %s after the topic's first refusal, beyond the bound %s", p.id, p.after.Round(time.Millisecond), bound)
		}
	}
}
