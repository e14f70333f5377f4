package inbox_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/engine"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/outbox"
)

// keyed is a message of partition key key whose payload names it (e.g. "A1").
func keyed(key, name string) *message.Message {
	return outbox.SetPartitionKey(outbox.NewMessage([]byte(name)), key)
}

// effectOrder is the payloads of the applied effects, in the order they committed.
func (f *fixture) effectOrder() []string {
	f.t.Helper()
	rows, err := f.db.Pool.Query(context.Background(), `SELECT note FROM `+f.db.Table("effect")+` ORDER BY id`)
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

// A router consumer's retry lane: key A's first message asks for later twice (2 s each), then
// succeeds; keys B…Z, behind it on the same subscription, are applied meanwhile; A's later
// messages wait and are applied after it, in order; each once. Key X's head keeps asking for
// later and is given up after LaneMaxAttempts: X's later message then goes on, and the replay
// of the given-up one applies it once.
func TestRouterRetryLane(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, func(c *inbox.Config) {
		c.LaneInterval = 50 * time.Millisecond
		c.LaneMaxAttempts = 3
		c.ReplayInterval = 50 * time.Millisecond
	})
	logger := watermill.NopLogger{}
	// Kafka, one partition: the subscriber hands the router one message at a time, in order.
	k := kafkatest.Fake(t, 1)
	topic := kafkatest.Topic("orders")
	sub, err := kafka.NewSubscriber(inboxkafka.SubscriberConfig(k.Brokers(), kafkatest.Topic("billing")), logger)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: k.Brokers(), Marshaler: kafka.DefaultMarshaler{}}, logger)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	retry := middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond, ResetContextOnRetry: true, ShouldRetry: inbox.ShouldRetry}
	router.AddMiddleware(f.ib.Poison, retry.Middleware, middleware.Recoverer, f.ib.Middleware)
	router.AddPlugin(f.ib.RouterPlugin)
	var (
		mu      sync.Mutex
		tries   = map[string]int{}
		firstA1 time.Time
		fixedX  atomic.Bool
	)
	router.AddHandler("billing", topic, sub, "billing.invoiced", inbox.OutboxOnly{}, func(msg *message.Message) ([]*message.Message, error) {
		name := string(msg.Payload)
		mu.Lock()
		tries[name]++
		n := tries[name]
		if name == "A1" && n == 1 {
			firstA1 = time.Now()
		}
		mu.Unlock()
		switch {
		case name == "A1" && n <= 2:
			return nil, inbox.RetryAfter(errors.New("provider down"), 2*time.Second)
		case name == "X1" && !fixedX.Load():
			return nil, inbox.RetryAfter(errors.New("provider gone"), 100*time.Millisecond)
		}
		return nil, f.applyEffect(msg, name)
	})
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- router.Run(runCtx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	<-router.Running()

	msgs := []*message.Message{keyed("A", "A1"), keyed("X", "X1"), keyed("B", "B1"), keyed("A", "A2"), keyed("X", "X2")}
	for c := 'C'; c <= 'Z'; c++ {
		if c != 'X' {
			msgs = append(msgs, keyed(string(c), string(c)+"1"))
		}
	}
	msgs = append(msgs, keyed("A", "A3"))
	for _, m := range msgs {
		if err := pub.Publish(topic, m); err != nil {
			t.Fatal(err)
		}
	}
	// B…Z (but X) are applied while A1 waits.
	waitFor(t, "the other keys applied", func() bool { return f.count(`SELECT count(*) FROM `+f.db.Table("effect")) >= 24 })
	if got := f.effectOrder(); strings.Contains(strings.Join(got, ","), "A") {
		t.Fatalf("A applied before its head's time: %v", got)
	}
	// X1 asked for later three times (LaneMaxAttempts): given up; X2 goes on.
	waitFor(t, "X1 given up and X2 applied", func() bool {
		return f.count(`SELECT count(*) FROM `+f.db.Table("inbox_poison")) == 1 && f.count(`SELECT count(*) FROM `+f.db.Table("effect")+` WHERE note = 'X2'`) == 1
	})
	p := f.poisonOf(msgs[1].UUID)
	if p.attempts != 3 || !strings.Contains(p.err, "retry lane after 3 attempts") || !strings.Contains(p.err, "provider gone") {
		t.Errorf("X1's poison row: %+v", p)
	}
	waitFor(t, "A applied", func() bool { return f.count(`SELECT count(*) FROM `+f.db.Table("effect")+` WHERE note LIKE 'A%'`) == 3 })
	mu.Lock()
	waited := time.Since(firstA1)
	mu.Unlock()
	if waited < 4*time.Second {
		t.Errorf("A1 applied %s after its first attempt; it asked for 2 s twice", waited)
	}
	order := f.effectOrder()
	var a []string
	for _, s := range order {
		if strings.HasPrefix(s, "A") {
			a = append(a, s)
		}
	}
	if strings.Join(a, ",") != "A1,A2,A3" {
		t.Errorf("key A applied as %v, want A1, A2, A3 (full order %v)", a, order)
	}
	if n := f.count(`SELECT count(*) FROM ` + f.db.Table("inbox_parked")); n != 0 {
		t.Errorf("%d rows still parked", n)
	}
	if s := snapshot(f); s.Parked != 5 { // A1, X1 at their heads; A2, A3, X2 behind them
		t.Errorf("Parked counted %d, want 5", s.Parked)
	}
	// A redelivery of a message applied from the lane is a duplicate.
	if err := pub.Publish(topic, msgs[3].Copy()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the redelivery skipped", func() bool { return snapshot(f).Duplicates == 1 })

	// The lane's poison row replays like any other, once.
	fixedX.Store(true)
	if res, err := f.replay(inbox.ReplayFilter{Consumer: "billing", By: "test"}); err != nil || len(res.Requested) != 1 {
		t.Fatalf("replay: %v %+v", err, res)
	}
	waitFor(t, "X1 replayed", func() bool { return f.effects(msgs[1].UUID) == 1 })
	for _, m := range msgs {
		if n := f.effects(m.UUID); n != 1 {
			t.Errorf("%s applied %d times", m.Payload, n)
		}
	}
}

// RetryAfter's delay is clamped, its error unwraps to the handler's, and ShouldRetry leaves it
// to the Poison middleware.
func TestRetryAfterError(t *testing.T) {
	cause := errors.New("provider down")
	err := inbox.RetryAfter(cause, time.Nanosecond)
	var rl *inbox.RetryLater
	if !errors.As(err, &rl) || rl.After != 100*time.Millisecond || !errors.Is(err, cause) {
		t.Fatalf("RetryAfter(cause, 1ns) = %v (%+v)", err, rl)
	}
	if errors.As(inbox.RetryAfter(nil, 30*24*time.Hour), &rl); rl.After != 7*24*time.Hour || rl.Err == nil {
		t.Errorf("RetryAfter(nil, 30 days) = %+v", rl)
	}
	if inbox.ShouldRetry(middleware.RetryParams{Err: err}) {
		t.Error("ShouldRetry retries a RetryAfter in place")
	}
	if !inbox.ShouldRetry(middleware.RetryParams{Err: cause}) {
		t.Error("ShouldRetry does not retry an ordinary error")
	}
}

// A router without the Poison middleware cannot park a RetryAfter: the handler's error goes back
// to the router as any other (redelivered in place), and the inbox says what to install.
func TestRetryAfterWithoutPoisonWarns(t *testing.T) {
	t.Parallel()
	var logs testutil.SyncBuffer
	f := newFixture(t, func(c *inbox.Config) {
		c.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	h := f.ib.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, inbox.RetryAfter(errors.New("provider down"), time.Second)
	})
	msg := keyed("A", "A1")
	if _, err := h(msg); engine.AsRetryLater(err) == nil {
		t.Fatalf("the middleware returned %v; want the handler's RetryAfter", err)
	}
	if !strings.Contains(logs.String(), "the Poison middleware is not installed") {
		t.Errorf("no warning; logs:\n%s", logs.String())
	}
	if n := f.count(`SELECT count(*) FROM ` + f.db.Table("inbox_parked")); n != 0 || f.dedupRows() != 0 {
		t.Errorf("%d parked rows, %d dedup rows: nothing should be kept", n, f.dedupRows())
	}
}
