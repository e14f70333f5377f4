package inboxkafka_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/outbox"
)

// A batched consumer with a set-based handler (BatchFunc) gives up the messages it cannot
// apply; after the fix, the replay requests are applied by the running consumer through the
// same handler, each exactly once; a message that still fails is given up again with its
// attempts and replay count; a restart does not apply a replayed message again.
func TestBatchConsumerReplaysGivenUpMessages(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newBatchFixture(t, 2)
	counters := &inbox.Counters{}
	ib, err := inbox.New(inbox.Config{Pool: f.db.Pool, Schema: f.db.Schema, Consumer: "setbased", ReplayInterval: 20 * time.Millisecond, Metrics: counters})
	if err != nil {
		t.Fatal(err)
	}
	sent := f.produce(120, 8)
	bad := map[string]bool{}
	for i := 0; i < len(sent); i += 20 {
		bad[sent[i].uuid] = true // 6 messages
	}
	stillBad := sent[0].uuid
	var fixed atomic.Bool
	proc := ib.BatchFunc("", func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) ([]*message.Message, error) {
		for i, m := range msgs {
			if m.UUID == stillBad || (bad[m.UUID] && !fixed.Load()) {
				return nil, &inbox.MessageError{Index: i, Err: errors.New("bug: unknown currency")}
			}
		}
		for _, m := range msgs {
			m.SetContext(outbox.ContextWithTx(ctx, tx))
			if err := f.effect(m); err != nil {
				return nil, err
			}
		}
		return nil, nil
	})
	stop := f.start("setbased", proc, func(c *inboxkafka.BatchConfig) { c.MaxAttempts = 2 })
	waitUntil(t, "114 effects and 6 poison rows", func() bool {
		return f.count(`SELECT count(*) FROM `+f.db.Table("effect")) == 114 && f.count(`SELECT count(*) FROM `+f.db.Table("inbox_poison")) == 6
	})
	fixed.Store(true)
	if err := pgx.BeginFunc(ctx, f.db.Pool, func(tx pgx.Tx) error {
		res, err := f.admin().ReplayTx(ctx, tx, inbox.ReplayFilter{Consumer: "setbased"})
		if err == nil && len(res.Requested) != 6 {
			t.Errorf("requested %d, want 6", len(res.Requested))
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	state := func(s string) int {
		return f.count(`SELECT count(*) FROM `+f.db.Table("inbox_poison")+` WHERE state = $1`, s)
	}
	waitUntil(t, "5 replayed and one given up again", func() bool { return state(inbox.StateReplayed) == 5 && state(inbox.StatePoison) == 1 })
	stop()
	for _, s := range sent {
		want := 1
		if s.uuid == stillBad {
			want = 0
		}
		if n := f.count(`SELECT count(*) FROM `+f.db.Table("effect")+` WHERE msg_uuid = $1`, s.uuid); n != want {
			t.Errorf("message %s applied %d times, want %d", s.uuid, n, want)
		}
	}
	var attempts, replays int
	if err := f.db.Pool.QueryRow(ctx, `SELECT attempts, replays FROM `+f.db.Table("inbox_poison")+` WHERE message_uuid = $1`, stillBad).Scan(&attempts, &replays); err != nil ||
		attempts != 4 || replays != 1 {
		t.Errorf("the message that failed again: attempts %d, replays %d (%v), want 4 and 1", attempts, replays, err)
	}
	// The whole topic delivered again (a new group of the same consumer, from the start):
	// every message is a duplicate, the replayed and the given-up ones too.
	before := counters.Snapshot().Duplicates
	f.start("setbased-again", proc, nil)
	waitUntil(t, "the redelivery of all 120 skipped", func() bool { return counters.Snapshot().Duplicates-before == 120 })
	if n := f.count(`SELECT count(*) FROM ` + f.db.Table("effect")); n != 119 {
		t.Errorf("%d effects after the redelivery, want 119", n)
	}
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// admin is the inbox's Admin over the fixture's schema.
func (f *bfix) admin() *inbox.Admin {
	f.t.Helper()
	a, err := inbox.NewAdmin(f.db.Schema)
	if err != nil {
		f.t.Fatal(err)
	}
	return a
}
