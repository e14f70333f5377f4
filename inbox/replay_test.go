package inbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/engine"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/outbox"
)

// replay files a replay request in its own transaction.
func (f *fixture) replay(rf inbox.ReplayFilter) (inbox.ReplayResult, error) {
	var res inbox.ReplayResult
	admin, err := inbox.NewAdmin(f.db.Schema)
	if err != nil {
		return res, err
	}
	err = pgx.BeginFunc(context.Background(), f.db.Pool, func(tx pgx.Tx) error {
		var err error
		res, err = admin.ReplayTx(context.Background(), tx, rf)
		return err
	})
	return res, err
}

// poisonState is one poison row's replay state.
type poisonState struct {
	id               int64
	state            string
	attempts, replay int
	err              string
	history          []map[string]any
}

func (f *fixture) poisonOf(uuid string) poisonState {
	f.t.Helper()
	var p poisonState
	if err := f.db.Pool.QueryRow(context.Background(), `SELECT id, state, attempts, replays, error, history FROM `+f.db.Table("inbox_poison")+
		` WHERE message_uuid = $1`, uuid).Scan(&p.id, &p.state, &p.attempts, &p.replay, &p.err, &p.history); err != nil {
		f.t.Fatalf("poison row of %s: %v", uuid, err)
	}
	return p
}

func (f *fixture) states() map[string]int {
	f.t.Helper()
	rows, err := f.db.Pool.Query(context.Background(), `SELECT state, count(*) FROM `+f.db.Table("inbox_poison")+` GROUP BY state`)
	if err != nil {
		f.t.Fatal(err)
	}
	out := map[string]int{}
	for rows.Next() {
		var s string
		var n int
		if err := rows.Scan(&s, &n); err != nil {
			f.t.Fatal(err)
		}
		out[s] = n
	}
	return out
}

// A replay request: bad input and refusals change nothing, a dry run changes nothing, a
// request moves given-up rows to replay_requested with who asked, and a second request of the
// same rows is refused.
func TestReplayTxRequests(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, nil)
	audit := f.newInbox(func(c *inbox.Config) { c.Consumer = "audit" })
	settle := func(ib *inbox.Inbox, msg *message.Message, p inbox.GiveUp) {
		t.Helper()
		if p.Err == nil {
			p.Err = errors.New("constraint invoice_amount_check failed")
		}
		p.Attempts = 5
		if err := ib.SettlePoison(ctx, msg, p); err != nil {
			t.Fatal(err)
		}
	}
	b1, b2, b3 := outbox.NewMessage([]byte("1")), outbox.NewMessage([]byte("2")), outbox.NewMessage([]byte("3"))
	settle(f.ib, b1, inbox.GiveUp{})
	settle(f.ib, b2, inbox.GiveUp{Err: errors.New("timeout talking to the tax service")})
	settle(f.ib, b3, inbox.GiveUp{})
	a1 := outbox.NewMessage([]byte("a"))
	settle(audit, a1, inbox.GiveUp{})
	reply := outbox.NewMessage([]byte("reply"))
	settle(f.ib, reply, inbox.GiveUp{NoReplay: "a saga reply: resume the saga with `onceflow saga retry s-1`"})
	keyless := message.NewMessage("", []byte("keyless"))
	settle(f.ib, keyless, inbox.GiveUp{})
	var keylessID int64
	if err := f.db.Pool.QueryRow(ctx, `SELECT id FROM `+f.db.Table("inbox_poison")+` WHERE dedup_key IS NULL`).Scan(&keylessID); err != nil {
		t.Fatal(err)
	}
	id := func(m *message.Message) int64 { return f.poisonOf(m.UUID).id }
	unchanged := func(what string) {
		t.Helper()
		if s := f.states(); s[inbox.StatePoison] != 6 || len(s) != 1 {
			t.Fatalf("%s changed rows: %v", what, s)
		}
	}

	for _, bad := range []inbox.ReplayFilter{{}, {IDs: []int64{0}}, {Limit: -1, All: true}, {Limit: inbox.MaxReplayLimit + 1, All: true}} {
		if _, err := f.replay(bad); err == nil || !strings.Contains(err.Error(), "nothing requested") {
			t.Errorf("ReplayTx(%+v) = %v, want a refusal", bad, err)
		}
	}
	if _, err := f.replay(inbox.ReplayFilter{IDs: []int64{id(b1), 999999}}); !errors.Is(err, inbox.ErrNoPoisonRow) || !strings.Contains(err.Error(), "999999") {
		t.Errorf("an unknown id: %v", err)
	}
	if _, err := f.replay(inbox.ReplayFilter{IDs: []int64{id(b1)}, Consumer: "audit"}); !errors.Is(err, inbox.ErrNoPoisonRow) {
		t.Errorf("an id of another consumer: %v", err)
	}
	res, err := f.replay(inbox.ReplayFilter{IDs: []int64{id(b1), id(reply)}})
	if !errors.Is(err, inbox.ErrReplayRefused) || !strings.Contains(err.Error(), "onceflow saga retry s-1") || len(res.Refused) != 1 {
		t.Errorf("ids with a saga reply: %v %+v", err, res)
	}
	if _, err := f.replay(inbox.ReplayFilter{IDs: []int64{keylessID}}); !errors.Is(err, inbox.ErrReplayRefused) || !strings.Contains(err.Error(), "without a dedup key") {
		t.Errorf("a keyless row: %v", err)
	}
	if _, err := f.replay(inbox.ReplayFilter{Consumer: "biling"}); !errors.Is(err, inbox.ErrNoPoisonRow) || !strings.Contains(err.Error(), `consumer "biling"`) {
		t.Errorf("a mistyped consumer: %v", err)
	}
	unchanged("refused requests")

	res, err = f.replay(inbox.ReplayFilter{Consumer: "billing", DryRun: true})
	if err != nil || fmt.Sprint(res.Requested) != fmt.Sprint([]int64{id(b1), id(b2), id(b3)}) || len(res.Refused) != 2 {
		t.Fatalf("dry run: %v %+v", err, res)
	}
	unchanged("a dry run")
	res, err = f.replay(inbox.ReplayFilter{Consumer: "billing", ErrorContains: "TAX SERVICE", By: "cli:alice"})
	if err != nil || fmt.Sprint(res.Requested) != fmt.Sprint([]int64{id(b2)}) {
		t.Fatalf("by error text: %v %+v", err, res)
	}
	if p := f.poisonOf(b2.UUID); p.state != inbox.StateReplayRequested || len(p.history) != 1 || p.history[0]["by"] != "cli:alice" || p.history[0]["event"] != "requested" {
		t.Errorf("requested row: %+v", p)
	}
	// Limit: oldest first, and More says that more matched.
	res, err = f.replay(inbox.ReplayFilter{Consumer: "billing", Limit: 1, Since: time.Now().Add(-time.Hour)})
	if err != nil || fmt.Sprint(res.Requested) != fmt.Sprint([]int64{id(b1)}) || !res.More {
		t.Fatalf("limit 1: %v %+v", err, res)
	}
	if _, err := f.replay(inbox.ReplayFilter{Consumer: "billing", Since: time.Now().Add(time.Hour)}); !errors.Is(err, inbox.ErrNoPoisonRow) {
		t.Errorf("since the future: %v", err)
	}
	// A second request of the same row is refused; by filter it no longer matches.
	if _, err := f.replay(inbox.ReplayFilter{IDs: []int64{id(b1)}}); !errors.Is(err, inbox.ErrReplayRefused) || !strings.Contains(err.Error(), "requested already") {
		t.Errorf("second request by id: %v", err)
	}
	res, err = f.replay(inbox.ReplayFilter{All: true})
	if err != nil || fmt.Sprint(res.Requested) != fmt.Sprint([]int64{id(b3), id(a1)}) {
		t.Fatalf("--all: %v %+v", err, res)
	}
	if _, err := f.replay(inbox.ReplayFilter{Consumer: "billing"}); !errors.Is(err, inbox.ErrReplayRefused) {
		t.Errorf("only refused rows left: %v", err)
	}
	if s := f.states(); s[inbox.StateReplayRequested] != 4 || s[inbox.StatePoison] != 2 {
		t.Errorf("states: %v", s)
	}
}

// A router consumer behind ib.Poison gives up failing messages into inbox_poison (attempts,
// handler, publish topic); once the handler is fixed, a replay request is applied by
// ib.RouterPlugin through the same handler, exactly once, with the messages it returns in the
// outbox; a message that fails again is given up again, visibly; a second replay is refused;
// a redelivery of a replayed message is a duplicate.
func TestRouterPoisonReplay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var logs testutil.SyncBuffer
	f := newFixture(t, func(c *inbox.Config) {
		c.ReplayInterval = 20 * time.Millisecond
		c.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	logger := watermill.NopLogger{}
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, logger)
	t.Cleanup(func() { _ = pubsub.Close() })
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	retry := middleware.Retry{MaxRetries: 1, InitialInterval: time.Millisecond, ResetContextOnRetry: true, ShouldRetry: inbox.ShouldRetry}
	router.AddMiddleware(f.ib.Poison, retry.Middleware, middleware.Recoverer, f.ib.Middleware)
	router.AddPlugin(f.ib.RouterPlugin)
	var fixed atomic.Bool
	router.AddHandler("billing", "orders", pubsub, "billing.invoiced", inbox.OutboxOnly{}, func(msg *message.Message) ([]*message.Message, error) {
		switch p := string(msg.Payload); {
		case p == "still-bad":
			return nil, errors.New("still broken")
		case strings.HasPrefix(p, "bug") && !fixed.Load():
			return nil, errors.New("bug: nil pointer")
		case p == "panic" && !fixed.Load():
			panic("handler bug")
		}
		if err := f.applyEffect(msg, string(msg.Payload)); err != nil {
			return nil, err
		}
		return []*message.Message{outbox.NewMessage(msg.Payload)}, nil
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

	var good, bad []*message.Message
	for i := range 10 {
		good = append(good, outbox.NewMessage(fmt.Appendf(nil, "ok-%d", i)))
	}
	for i := range 3 {
		bad = append(bad, outbox.NewMessage(fmt.Appendf(nil, "bug-%d", i)))
	}
	bad = append(bad, outbox.NewMessage([]byte("panic")))
	stillBad := outbox.NewMessage([]byte("still-bad"))
	keyless := message.NewMessage("", []byte("keyless"))
	for _, m := range append(append(append([]*message.Message{}, good...), bad...), stillBad, keyless) {
		if err := pubsub.Publish("orders", m); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "10 effects and 6 poison rows", func() bool {
		return f.count(`SELECT count(*) FROM `+f.db.Table("effect")) == 10 && f.count(`SELECT count(*) FROM `+f.db.Table("inbox_poison")) == 6
	})
	var handler, topic, source string
	if err := f.db.Pool.QueryRow(ctx, `SELECT handler, publish_topic, source FROM `+f.db.Table("inbox_poison")+` WHERE message_uuid = $1`, bad[0].UUID).
		Scan(&handler, &topic, &source); err != nil || handler != "billing" || topic != "billing.invoiced" || source != "orders" {
		t.Fatalf("router poison row: handler %q, publish topic %q, source %q (%v)", handler, topic, source, err)
	}
	if p := f.poisonOf(bad[0].UUID); p.attempts != 2 || !strings.Contains(p.err, "bug: nil pointer") {
		t.Errorf("attempts and error of a router poison row: %+v", p)
	}
	if p := f.poisonOf(bad[3].UUID); !strings.Contains(p.err, "handler bug") {
		t.Errorf("a panic's poison row: %+v", p)
	}
	// Given up means skipped: a redelivery of a poisoned message changes nothing.
	if err := pubsub.Publish("orders", bad[0].Copy()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the redelivery skipped", func() bool { return snapshot(f).Duplicates == 1 })

	fixed.Store(true) // the fix is deployed
	res, err := f.replay(inbox.ReplayFilter{Consumer: "billing", By: "test"})
	if err != nil || len(res.Requested) != 5 || len(res.Refused) != 1 {
		t.Fatalf("replay request: %v %+v", err, res)
	}
	waitFor(t, "the replays applied", func() bool {
		s := f.states()
		return s[inbox.StateReplayed] == 4 && s[inbox.StatePoison] == 2 && s[inbox.StateReplayRequested] == 0
	})
	// The still-bad message's retries during its replay say what waits for them.
	if l := logs.String(); !strings.Contains(l, "trying it again alone (the next replay waits)") || strings.Contains(l, "partition wait") {
		t.Errorf("a replay's retries were logged as:\n%s", l)
	}
	for _, m := range append(good, bad...) {
		if n := f.effects(m.UUID); n != 1 {
			t.Errorf("message %s applied %d times", m.Payload, n)
		}
	}
	for _, m := range bad {
		if p := f.poisonOf(m.UUID); p.state != inbox.StateReplayed || p.replay != 1 || len(p.history) != 2 || p.history[1]["event"] != "replayed" {
			t.Errorf("replayed row %s: %+v", m.Payload, p)
		}
	}
	invoiced := 0
	for _, r := range f.outboxRows() {
		if r.Topic != "billing.invoiced" {
			t.Errorf("outbox row on topic %q", r.Topic)
		}
		invoiced++
	}
	if invoiced != 14 {
		t.Errorf("%d outbox rows, want one per applied message (14)", invoiced)
	}
	// Failed again: back to poison, attempts and replays counted, the new error, the history.
	p := f.poisonOf(stillBad.UUID)
	if p.state != inbox.StatePoison || p.attempts != 2+engine.DefaultMaxAttempts || p.replay != 1 || len(p.history) != 2 ||
		p.history[1]["event"] != "failed" || !strings.Contains(fmt.Sprint(p.history[1]["error"]), "still broken") || f.effects(stillBad.UUID) != 0 {
		t.Errorf("a replay that failed again: %+v", p)
	}
	// A second replay of a replayed row is refused, and a redelivery is still a duplicate.
	if _, err := f.replay(inbox.ReplayFilter{IDs: []int64{f.poisonOf(bad[1].UUID).id}}); !errors.Is(err, inbox.ErrReplayRefused) ||
		!strings.Contains(err.Error(), "replayed already") {
		t.Errorf("second replay: %v", err)
	}
	if err := pubsub.Publish("orders", bad[1].Copy()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the redelivery of a replayed message skipped", func() bool { return snapshot(f).Duplicates == 2 })
	if n := f.effects(bad[1].UUID); n != 1 {
		t.Errorf("replayed message applied %d times after its redelivery", n)
	}
	var hist []byte
	if err := f.db.Pool.QueryRow(ctx, `SELECT history FROM `+f.db.Table("inbox_poison")+` WHERE message_uuid = $1`, bad[1].UUID).Scan(&hist); err != nil || !json.Valid(hist) {
		t.Errorf("history: %s %v", hist, err)
	}
}
