package inbox_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/outbox"
)

// ackWatch is a Subscriber that counts, per message UUID, the deliveries the router
// acknowledged and those it nacked (which the Go channel delivers again).
type ackWatch struct {
	message.Subscriber
	mu          sync.Mutex
	acks, nacks map[string]int
	stop        chan struct{}
	once        sync.Once
	wg          sync.WaitGroup
}

func newAckWatch(sub message.Subscriber) *ackWatch {
	return &ackWatch{Subscriber: sub, acks: map[string]int{}, nacks: map[string]int{}, stop: make(chan struct{})}
}

func (s *ackWatch) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := s.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer close(out)
		for m := range in {
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				select {
				case <-m.Acked():
					s.count(s.acks, m.UUID)
				case <-m.Nacked():
					s.count(s.nacks, m.UUID)
				case <-s.stop:
				}
			}()
			select {
			case out <- m:
			case <-ctx.Done():
			case <-s.stop:
			}
		}
	}()
	return out, nil
}

func (s *ackWatch) count(m map[string]int, uuid string) {
	s.mu.Lock()
	m[uuid]++
	s.mu.Unlock()
}

func (s *ackWatch) counts(uuid string) (acks, nacks int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.acks[uuid], s.nacks[uuid]
}

func (s *ackWatch) Close() error {
	err := s.Subscriber.Close() // ends the subscriptions: their channels close
	s.once.Do(func() { close(s.stop) })
	s.wg.Wait()
	return err
}

// Issue 33: a router handler behind the recommended chain (ib.Poison, Retry with 2 retries,
// Timeout, Recoverer, ib.Middleware) that always outlasts Timeout returns
// context.DeadlineExceeded — the handler's own deadline, not the database's failure. After its
// 3 attempts the message is given up: one inbox_poison row with attempts 3, and the delivery
// acknowledged, never nacked. (context.DeadlineExceeded is a net.Error, and ib.Poison used to
// take it for the database's failure: nacked and redelivered forever.)
func TestRouterGivesUpAMessageThatKeepsTimingOut(t *testing.T) {
	t.Parallel()
	f := newFixture(t, func(c *inbox.Config) { c.ReplayInterval = time.Hour })
	logger := watermill.NopLogger{}
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, logger)
	sub := newAckWatch(pubsub)
	t.Cleanup(func() { _ = sub.Close() })
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	retry := middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond, ResetContextOnRetry: true, ShouldRetry: inbox.ShouldRetry}
	router.AddMiddleware(f.ib.Poison, retry.Middleware, middleware.Timeout(250*time.Millisecond), middleware.Recoverer, f.ib.Middleware)
	router.AddPlugin(f.ib.RouterPlugin)
	var calls atomic.Int32
	router.AddConsumerHandler("billing", "orders", sub, func(msg *message.Message) error {
		calls.Add(1)
		<-msg.Context().Done() // a call that outlasts the handler's deadline
		return msg.Context().Err()
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

	msg := outbox.NewMessage([]byte("slow"))
	if err := pubsub.Publish("orders", msg); err != nil {
		t.Fatal(err)
	}
	poisonRows := func() int {
		return f.count(`SELECT count(*) FROM `+f.db.Table("inbox_poison")+` WHERE message_uuid = $1`, msg.UUID)
	}
	testutil.AwaitWithin(t, 20*time.Second, "the message given up and acknowledged",
		func() bool { acks, _ := sub.counts(msg.UUID); return poisonRows() == 1 && acks == 1 },
		func() string {
			acks, nacks := sub.counts(msg.UUID)
			return fmt.Sprintf("%d poison rows, %d acks, %d nacks, %d handler calls (its deadline was taken for the database's failure: nacked and redelivered forever)",
				poisonRows(), acks, nacks, calls.Load())
		})
	var attempts int
	var reason string
	if err := f.db.Pool.QueryRow(context.Background(), `SELECT attempts, error FROM `+f.db.Table("inbox_poison")+` WHERE message_uuid = $1`, msg.UUID).
		Scan(&attempts, &reason); err != nil {
		t.Fatal(err)
	}
	if attempts != 3 || !strings.Contains(reason, context.DeadlineExceeded.Error()) {
		t.Errorf("poison row: attempts %d, error %q; want 1+MaxRetries = 3 and the deadline", attempts, reason)
	}
	// An attempt whose deadline passed before its transaction began (a slow machine, -race)
	// counts without calling the handler: at most 3 calls.
	if _, nacks := sub.counts(msg.UUID); nacks != 0 || calls.Load() < 1 || calls.Load() > 3 {
		t.Errorf("%d nacks, %d handler calls; want 0 and at most 3 (one delivery, its 3 attempts)", nacks, calls.Load())
	}
}

// Beyond issue 33's list, found while writing the test above: the router closing (a
// shutdown, a revoked partition) while a handler waits on its context is nobody's failure —
// the message must be redelivered, not given up. Its context.Canceled is not the handler's
// deadline (context.DeadlineExceeded, which is the message's), and a rule that makes handler
// deadlines the message's must keep the two apart. (ib.Poison gave the in-flight message up,
// with one attempt and "context canceled", so a graceful shutdown parked it.)
func TestRouterClosingGivesNothingUp(t *testing.T) {
	t.Parallel()
	f := newFixture(t, func(c *inbox.Config) { c.ReplayInterval = time.Hour })
	logger := watermill.NopLogger{}
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, logger)
	t.Cleanup(func() { _ = pubsub.Close() })
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	retry := middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond, ResetContextOnRetry: true, ShouldRetry: inbox.ShouldRetry}
	router.AddMiddleware(f.ib.Poison, retry.Middleware, middleware.Timeout(time.Minute), middleware.Recoverer, f.ib.Middleware)
	router.AddPlugin(f.ib.RouterPlugin)
	started := make(chan struct{}, 16)
	router.AddConsumerHandler("billing", "orders", pubsub, func(msg *message.Message) error {
		started <- struct{}{}
		<-msg.Context().Done() // a call still running when the router closes
		return msg.Context().Err()
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	<-router.Running()
	msg := outbox.NewMessage([]byte("in flight"))
	if err := pubsub.Publish("orders", msg); err != nil {
		t.Fatal(err)
	}
	select {
	case <-started:
	case <-time.After(20 * time.Second):
		t.Fatal("the handler did not start within 20 s")
	}
	cancel() // shutdown
	if err := <-done; err != nil {
		t.Error(err)
	}
	var reason string
	if err := f.db.Pool.QueryRow(context.Background(), `SELECT coalesce(max(error), '') FROM `+f.db.Table("inbox_poison")+` WHERE message_uuid = $1`, msg.UUID).
		Scan(&reason); err != nil {
		t.Fatal(err)
	}
	if reason != "" || f.dedupRows() != 0 {
		t.Errorf("the router's shutdown gave the in-flight message up (poison row error %q, %d dedup rows); want it left for redelivery", reason, f.dedupRows())
	}
}
