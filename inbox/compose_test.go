package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/outbox"
)

// The recommended middleware order on a real router, outermost first:
//
//	PoisonQueue → Retry (ResetContextOnRetry) → Timeout → Recoverer → inbox → handler
//
// Flaky handlers succeed on a retry with one effect; a panicking handler is retried, then
// poisoned, leaving nothing; an attempt cut by Timeout is rolled back and retried; a keyless
// message goes to the poison queue without retries and without running the handler; a
// redelivered message is skipped.
func TestRecommendedMiddlewareOrder(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	logger := watermill.NopLogger{}
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, logger)
	t.Cleanup(func() { _ = pubsub.Close() }) // ends the "poison" subscription's goroutine
	poisoned, err := pubsub.Subscribe(context.Background(), "poison")
	if err != nil {
		t.Fatal(err)
	}
	poison, err := middleware.PoisonQueue(pubsub, "poison")
	if err != nil {
		t.Fatal(err)
	}
	retry := middleware.Retry{MaxRetries: 2, InitialInterval: 5 * time.Millisecond, ResetContextOnRetry: true, ShouldRetry: inbox.ShouldRetry}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(poison, retry.Middleware, middleware.Timeout(5*time.Second), middleware.Recoverer, f.ib.Middleware)

	var mu sync.Mutex
	attempts := map[string]int{}
	router.AddConsumerHandler("billing", "orders", pubsub, func(msg *message.Message) error {
		mu.Lock()
		attempts[string(msg.Payload)]++
		n := attempts[string(msg.Payload)]
		mu.Unlock()
		if err := f.applyEffect(msg, string(msg.Payload)); err != nil {
			return err
		}
		switch string(msg.Payload) {
		case "flaky":
			if n <= 2 {
				return fmt.Errorf("flaky attempt %d", n)
			}
		case "panic":
			panic("handler bug")
		case "slow":
			if n == 1 {
				// Blocks until Timeout cancels the attempt's context.
				_, err := outbox.MustTx(msg.Context()).Exec(msg.Context(), `SELECT pg_sleep(120)`)
				return err
			}
		}
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	<-router.Running()

	ok := outbox.NewMessage([]byte("ok"))
	msgs := []*message.Message{
		ok,
		outbox.NewMessage([]byte("flaky")),
		outbox.NewMessage([]byte("panic")),
		outbox.NewMessage([]byte("slow")),
		message.NewMessage("", []byte("keyless")),
	}
	for _, m := range msgs {
		if err := pubsub.Publish("orders", m); err != nil {
			t.Fatal(err)
		}
	}
	reasons := map[string]string{}
	for len(reasons) < 2 {
		select {
		case p := <-poisoned:
			reasons[string(p.Payload)] = p.Metadata.Get(middleware.ReasonForPoisonedKey)
			p.Ack()
		case <-time.After(2 * time.Minute):
			t.Fatalf("poison queue got %v, want the panicking and the keyless message", reasons)
		}
	}
	if !strings.Contains(reasons["panic"], "handler bug") || !strings.Contains(reasons["keyless"], inbox.ErrNoKey.Error()) {
		t.Fatalf("poison reasons %q", reasons)
	}
	waitFor(t, "the three good messages", func() bool { return snapshot(f).Processed == 3 })
	if err := pubsub.Publish("orders", ok.Copy()); err != nil { // the broker delivers it again
		t.Fatal(err)
	}
	waitFor(t, "the redelivery", func() bool { return snapshot(f).Duplicates == 1 })

	mu.Lock()
	defer mu.Unlock()
	wantAttempts := map[string]int{"ok": 1, "flaky": 3, "panic": 3, "slow": 2}
	if fmt.Sprint(attempts) != fmt.Sprint(wantAttempts) {
		t.Errorf("handler attempts %v, want %v", attempts, wantAttempts)
	}
	for _, m := range msgs {
		want := 1
		if p := string(m.Payload); p == "panic" || p == "keyless" {
			want = 0
		}
		if n := f.effects(m.UUID); n != want {
			t.Errorf("%s: %d effects, want %d", m.Payload, n, want)
		}
	}
	if n := f.dedupRows(); n != 3 {
		t.Errorf("dedup rows %d, want 3 (failed attempts must leave none)", n)
	}
	if s := snapshot(f); s.Processed != 3 || s.Duplicates != 1 || s.NoKeys != 1 || s.Failures != 2+3+1 {
		t.Errorf("metrics %+v", s)
	}
}

// Watermill's Timeout leaves its cancelled context on the message; without
// ResetContextOnRetry every later attempt starts cancelled. This pins down why the documented
// order sets ResetContextOnRetry when Timeout sits inside Retry.
func TestTimeoutInsideRetryNeedsResetContext(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	attempts := 0
	h := func(msg *message.Message) ([]*message.Message, error) {
		attempts++
		if attempts == 1 {
			<-msg.Context().Done()
			return nil, msg.Context().Err()
		}
		return nil, f.applyEffect(msg, "")
	}
	for _, reset := range []bool{false, true} {
		attempts = 0
		retry := middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond, ResetContextOnRetry: reset}
		chain := retry.Middleware(middleware.Timeout(2 * time.Second)(f.ib.Middleware(h)))
		msg := outbox.NewMessage([]byte("x"))
		_, err := chain(msg)
		if reset && (err != nil || f.effects(msg.UUID) != 1) {
			t.Fatalf("with ResetContextOnRetry: err %v, effects %d", err, f.effects(msg.UUID))
		}
		if !reset && (!errors.Is(err, context.DeadlineExceeded) || attempts != 1 || f.effects(msg.UUID) != 0) {
			t.Fatalf("without ResetContextOnRetry: err %v after %d handler attempts; expected later attempts to start cancelled", err, attempts)
		}
	}
}

// Timeout inside Retry without ResetContextOnRetry (against the documented order) leaves later
// attempts a cancelled context. That cancellation is a middleware's, not the consumer
// stopping: Poison gives the message up after its attempts (with the handler's error) instead
// of taking it for the database's failure and nacking it forever.
func TestLeftoverCancelledContextIsNotAStop(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	h := func(*message.Message) ([]*message.Message, error) { return nil, errors.New("tax service: bad request") }
	retry := middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond}
	chain := f.ib.Poison(retry.Middleware(middleware.Timeout(2 * time.Second)(f.ib.Middleware(h))))
	msg := outbox.NewMessage([]byte("x"))
	if _, err := chain(msg); err != nil {
		t.Fatalf("Poison returned %v: the message would be nacked and redelivered forever", err)
	}
	if n := f.count(`SELECT count(*) FROM `+f.db.Table("inbox_poison")+` WHERE message_uuid = $1 AND attempts = 3`, msg.UUID); n != 1 {
		t.Fatalf("%d poison rows with 3 attempts", n)
	}
}
