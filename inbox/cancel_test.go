package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/outbox"
)

// The message's context is cancelled after the handler's work succeeded — watermill-kafka does
// that when the subscriber closes or the partition is revoked — but before the inbox commits.
// The work is committed once (effect, event and dedup row), and the redelivery, which a
// rebalance brings if the offset was not committed, is a duplicate.
func TestSucceededWorkCommitsDespiteCancellation(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	for _, how := range []string{"cancel", "deadline"} {
		ctx, cancel := context.WithCancel(context.Background())
		if how == "deadline" { // middleware.Timeout's deadline passes as the handler finishes
			ctx, cancel = context.WithTimeout(context.Background(), 50*time.Millisecond)
		}
		defer cancel()
		msg := outbox.NewMessage([]byte(how))
		msg.SetContext(ctx)
		runs := 0
		h := f.ib.Middleware(func(m *message.Message) ([]*message.Message, error) {
			runs++
			if err := f.applyEffect(m, ""); err != nil {
				return nil, err
			}
			if how == "cancel" {
				cancel()
			}
			<-m.Context().Done()
			return []*message.Message{outbox.ToTopic(outbox.NewMessage([]byte(m.UUID)), "events")}, nil
		})
		if _, err := h(msg); err != nil {
			t.Fatalf("%s after the handler succeeded: %v; want the work committed", how, err)
		}
		redelivery := msg.Copy() // a fresh context, as after a rebalance
		if _, err := h(redelivery); err != nil {
			t.Fatalf("%s: redelivery: %v", how, err)
		}
		if got := [4]int{f.effects(msg.UUID), f.eventsOf(msg), f.dedupOf(msg), runs}; got != [4]int{1, 1, 1, 1} {
			t.Fatalf("%s: effects, events, dedup rows, runs = %v; want 1 each", how, got)
		}
	}
	if s := snapshot(f); s.Processed != 2 || s.Duplicates != 2 || s.Failures != 0 {
		t.Fatalf("metrics %+v", s)
	}
}

// CommitTimeout bounds the detached commit, and a negative one is refused.
func TestCommitTimeoutConfig(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	if got := f.ib.Config().CommitTimeout; got != inbox.DefaultCommitTimeout {
		t.Fatalf("default CommitTimeout %s; want %s", got, inbox.DefaultCommitTimeout)
	}
	if _, err := inbox.New(inbox.Config{Pool: f.db.Pool, Consumer: "c", CommitTimeout: -time.Second}); err == nil {
		t.Fatal("a negative CommitTimeout was accepted")
	}
}
