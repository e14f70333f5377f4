package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/outbox"
)

// stateDuplicate is the poison row state issue 33 adds for a replay whose dedup claim found
// the key taken (another delivery applied the message meanwhile).
const stateDuplicate = "duplicate"

// Issue 33: a replay whose dedup claim finds the key taken — another delivery of the message
// applied it meanwhile — must not run the handler, must not be reported as replayed, and must
// not be tried again on the next look: the row's state becomes "duplicate", with a
// "duplicate" event in its history.
//
// Built deterministically: while a transaction of the test holds the message's dedup row
// (deleted and inserted again, uncommitted: a delivery applying it), the replay is requested;
// the consumer's replay blocks on that row; then the test commits. (The replay used to roll
// back, log "replayed", leave the row requested, and on the next look delete the other
// delivery's dedup row and run the handler a second time.)
func TestReplayWhoseKeyIsTakenIsADuplicate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, func(c *inbox.Config) { c.ReplayInterval = 20 * time.Millisecond })
	r := startReplayRouter(t, f)
	broken, pubsub := &r.broken, r.pubsub

	m, n := outbox.NewMessage([]byte("m")), outbox.NewMessage([]byte("n"))
	for _, msg := range []*message.Message{m, n} {
		if err := pubsub.Publish("orders", msg); err != nil {
			t.Fatal(err)
		}
	}
	testutil.AwaitWithin(t, 20*time.Second, "both messages given up", func() bool {
		return f.count(`SELECT count(*) FROM `+f.db.Table("inbox_poison")) == 2
	}, func() string { return fmt.Sprintf("states %v", f.states()) })
	broken.Store(false) // the fix is deployed

	var key string
	if err := f.db.Pool.QueryRow(ctx, `SELECT dedup_key FROM `+f.db.Table("inbox_poison")+` WHERE message_uuid = $1`, m.UUID).Scan(&key); err != nil {
		t.Fatal(err)
	}
	// Another delivery of m applies it: its transaction holds m's dedup row until it commits.
	other, err := f.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Rollback(ctx) }()
	var otherPID int32
	if err := other.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&otherPID); err != nil {
		t.Fatal(err)
	}
	tag, err := other.Exec(ctx, `DELETE FROM `+f.db.Table("processed_event")+` WHERE consumer = 'billing' AND dedup_key = $1`, key)
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("delete m's dedup row: %v (%d rows)", err, tag.RowsAffected())
	}
	if _, err := other.Exec(ctx, `INSERT INTO `+f.db.Table("processed_event")+` (consumer, dedup_key) VALUES ('billing', $1)`, key); err != nil {
		t.Fatal(err)
	}

	if _, err := f.replay(inbox.ReplayFilter{IDs: []int64{f.poisonOf(m.UUID).id}, By: "test"}); err != nil {
		t.Fatal(err)
	}
	blocked := func() int {
		return f.count(`SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))`, otherPID)
	}
	testutil.AwaitWithin(t, 20*time.Second, "the replay of m waiting for the other delivery's dedup row", func() bool { return blocked() > 0 },
		func() string { return fmt.Sprintf("m's row is %q", f.poisonOf(m.UUID).state) })
	if err := other.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	testutil.AwaitWithin(t, 20*time.Second, "the replay of m settled", func() bool { return f.poisonOf(m.UUID).state != inbox.StateReplayRequested },
		func() string { return "m's row is still replay_requested" })

	// Later looks: n's replay, requested now, is applied after them.
	if _, err := f.replay(inbox.ReplayFilter{IDs: []int64{f.poisonOf(n.UUID).id}, By: "test"}); err != nil {
		t.Fatal(err)
	}
	testutil.AwaitWithin(t, 20*time.Second, "the replay of n applied", func() bool { return f.poisonOf(n.UUID).state == inbox.StateReplayed },
		func() string { return fmt.Sprintf("n's row is %q", f.poisonOf(n.UUID).state) })

	runsM, runsN := r.runsOf(m.UUID), r.runsOf(n.UUID)
	if runsM != 0 || f.effects(m.UUID) != 0 {
		t.Errorf("the handler ran %d times for m (%d effects) after another delivery had applied it; want 0: the replay found its key taken",
			runsM, f.effects(m.UUID))
	}
	p := f.poisonOf(m.UUID)
	var events []any
	for _, h := range p.history {
		events = append(events, h["event"])
	}
	if p.state != stateDuplicate || len(events) == 0 || events[len(events)-1] != stateDuplicate {
		t.Errorf("m's row: state %q, history events %v; want state %q and a last event %q (not replayed, not requested again)",
			p.state, events, stateDuplicate, stateDuplicate)
	}
	if runsN != 1 || f.effects(n.UUID) != 1 {
		t.Errorf("n: %d handler runs, %d effects; want 1 and 1", runsN, f.effects(n.UUID))
	}
}

// replayRouter is a router consumer "billing" whose handler fails while broken is set, with
// the Poison middleware and the replay plugin.
type replayRouter struct {
	pubsub *gochannel.GoChannel
	broken atomic.Bool
	mu     sync.Mutex
	runs   map[string]int // successful handler runs per message
}

func (r *replayRouter) runsOf(uuid string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.runs[uuid]
}

func startReplayRouter(t *testing.T, f *fixture) *replayRouter {
	t.Helper()
	logger := watermill.NopLogger{}
	r := &replayRouter{pubsub: gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, logger), runs: map[string]int{}}
	t.Cleanup(func() { _ = r.pubsub.Close() })
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(f.ib.Poison, f.ib.Middleware)
	router.AddPlugin(f.ib.RouterPlugin)
	r.broken.Store(true)
	router.AddConsumerHandler("billing", "orders", r.pubsub, func(msg *message.Message) error {
		if r.broken.Load() {
			return errors.New("bug: cannot apply it yet")
		}
		r.mu.Lock()
		r.runs[msg.UUID]++
		r.mu.Unlock()
		return f.applyEffect(msg, string(msg.Payload))
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	<-router.Running()
	return r
}

// A replay requested after the message's dedup row expired (the retention window) and another
// delivery applied it again removes only the dedup row written when the message was given up:
// the later delivery's row stays, the claim finds the key taken, and the handler does not run
// a second time (state duplicate). (The replay used to delete the later row and run it again.)
func TestReplayAfterRetentionAndARedeliveryIsADuplicate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, func(c *inbox.Config) { c.ReplayInterval = 20 * time.Millisecond })
	r := startReplayRouter(t, f)
	m := outbox.NewMessage([]byte("m"))
	if err := r.pubsub.Publish("orders", m); err != nil {
		t.Fatal(err)
	}
	testutil.AwaitWithin(t, 20*time.Second, "m given up", func() bool { return f.count(`SELECT count(*) FROM `+f.db.Table("inbox_poison")) == 1 },
		func() string { return fmt.Sprintf("states %v", f.states()) })
	r.broken.Store(false)
	// The retention window passed: the dedup row is gone. The message came again and was applied.
	pe := f.db.Table("processed_event")
	if _, err := f.db.Pool.Exec(ctx, `DELETE FROM `+pe+` WHERE consumer = 'billing'`); err != nil {
		t.Fatal(err)
	}
	if err := r.pubsub.Publish("orders", m.Copy()); err != nil {
		t.Fatal(err)
	}
	testutil.AwaitWithin(t, 20*time.Second, "the redelivery applied", func() bool { return f.effects(m.UUID) == 1 }, func() string { return "no effect" })
	if _, err := f.replay(inbox.ReplayFilter{IDs: []int64{f.poisonOf(m.UUID).id}, By: "test"}); err != nil {
		t.Fatal(err)
	}
	testutil.AwaitWithin(t, 20*time.Second, "the replay settled", func() bool { return f.poisonOf(m.UUID).state != inbox.StateReplayRequested },
		func() string { return "still requested" })
	if p := f.poisonOf(m.UUID); p.state != stateDuplicate || r.runsOf(m.UUID) != 1 || f.effects(m.UUID) != 1 {
		t.Errorf("state %q, %d handler runs, %d effects; want duplicate, 1 (the redelivery's) and 1", p.state, r.runsOf(m.UUID), f.effects(m.UUID))
	}
}
