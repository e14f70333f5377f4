package inboxkafka_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/outbox"
)

// Issue 33: replay requests are scoped to the handler (and topic) that gave the message up.
// Two batched consumers — different groups, topics and handlers — whose Inboxes share one
// Consumer name each give up a message, and a router handler of the same name gives up a
// third. After a replay request of all of them, each batched consumer replays only its own
// row, through its own handler, with the subscribe topic its live messages carry; neither
// runs the router's row. (Every batched consumer used to take every request of the name —
// router rows included — and run it through its own handler, without a subscribe topic.)
func TestBatchReplaysRunOnlyTheirOwnHandlersRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newBatchFixture(t, 1)
	topicA, topicB := f.topic, kafkatest.Topic("other")
	ran := f.db.Table("ran")
	if _, err := f.db.Pool.Exec(ctx, `CREATE TABLE `+ran+` (id bigserial PRIMARY KEY, handler text NOT NULL, msg_uuid text NOT NULL, topic text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	var broken atomic.Bool
	broken.Store(true)
	// handler records, in the message's transaction, which handler applied which message and
	// the subscribe topic it saw; it fails while broken is set.
	handler := func(name string) message.NoPublishHandlerFunc {
		return func(msg *message.Message) error {
			if broken.Load() {
				return fmt.Errorf("handler %s cannot apply it yet", name)
			}
			_, err := outbox.MustTx(msg.Context()).Exec(msg.Context(), `INSERT INTO `+ran+` (handler, msg_uuid, topic) VALUES ($1, $2, $3)`,
				name, msg.UUID, message.SubscribeTopicFromCtx(msg.Context()))
			return err
		}
	}
	newInbox := func() *inbox.Inbox {
		ib, err := inbox.New(inbox.Config{Pool: f.db.Pool, Schema: f.db.Schema, Consumer: "shared", ReplayInterval: 20 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		return ib
	}
	procA, procB := newInbox().BatchNoPublish(handler("A")), newInbox().BatchNoPublish(handler("B"))
	onA := func(c *inboxkafka.BatchConfig) { c.MaxAttempts = 1 }
	onB := func(c *inboxkafka.BatchConfig) { c.Topics = []string{topicB}; c.MaxAttempts = 1 }

	// The rows are given up in the order B, router, A: a consumer that takes every row of the
	// name meets the others' rows before its own.
	stopB := f.start("group-b", procB, onB)
	msgB := produceRaw(t, f.brokers, topicB, "kb", []byte(`{}`))[0]
	waitPoison(t, f, msgB)
	msgR := routerPoisonRow(t, f, newInbox(), handler("R"))
	f.start("group-a", procA, onA)
	msgA := produceRaw(t, f.brokers, topicA, "ka", []byte(`{}`))[0]
	waitPoison(t, f, msgA)

	// B is down while the replay is requested: its row must wait for it.
	stopB()
	broken.Store(false) // the fix is deployed
	if err := pgx.BeginFunc(ctx, f.db.Pool, func(tx pgx.Tx) error {
		res, err := f.admin().ReplayTx(ctx, tx, inbox.ReplayFilter{Consumer: "shared", By: "test"})
		if err == nil && len(res.Requested) != 3 {
			t.Errorf("requested %v, want the 3 rows", res.Requested)
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	state := func(uuid string) string {
		var s string
		if err := f.db.Pool.QueryRow(ctx, `SELECT state FROM `+f.db.Table("inbox_poison")+` WHERE message_uuid = $1`, uuid).Scan(&s); err != nil {
			t.Fatalf("poison row of %s: %v", uuid, err)
		}
		return s
	}
	ranBy := func() map[string][]string {
		rows, err := f.db.Pool.Query(ctx, `SELECT msg_uuid, handler || ' (subscribe topic ' || quote_literal(topic) || ')' FROM `+ran+` ORDER BY id`)
		if err != nil {
			t.Fatal(err)
		}
		out := map[string][]string{}
		for rows.Next() {
			var uuid, by string
			if err := rows.Scan(&uuid, &by); err != nil {
				t.Fatal(err)
			}
			out[uuid] = append(out[uuid], by)
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return out
	}
	testutil.AwaitWithin(t, 20*time.Second, "consumer A replays its own row",
		func() bool { return state(msgA) != inbox.StateReplayRequested },
		func() string { return fmt.Sprintf("handlers ran %v", ranBy()) })
	f.start("group-b", procB, onB) // B is back
	testutil.AwaitWithin(t, 20*time.Second, "consumer B replays its own row",
		func() bool { return state(msgB) != inbox.StateReplayRequested },
		func() string { return fmt.Sprintf("handlers ran %v", ranBy()) })

	got := ranBy()
	names := map[string]string{msgA: "A's row", msgB: "B's row", msgR: "the router's row"}
	want := map[string]string{
		msgA: fmt.Sprintf("A (subscribe topic '%s')", topicA),
		msgB: fmt.Sprintf("B (subscribe topic '%s')", topicB),
	}
	for _, uuid := range []string{msgA, msgB, msgR} {
		w, g := want[uuid], strings.Join(got[uuid], ", ")
		if g == w {
			continue
		}
		if w == "" {
			w = "no handler: no batched consumer may run a router handler's row"
		}
		t.Errorf("%s (message %s) was replayed by %q, want %s", names[uuid], uuid, g, w)
	}
	for uuid, w := range map[string]string{msgA: inbox.StateReplayed, msgB: inbox.StateReplayed, msgR: inbox.StateReplayRequested} {
		if s := state(uuid); s != w {
			t.Errorf("%s: state %q, want %q", names[uuid], s, w)
		}
	}
}

// routerPoisonRow has a router handler of ib (Watermill router over a Go channel, behind
// ib.Poison and ib.Middleware, without the replay plugin) give a message up, and returns its
// UUID once its poison row exists.
func routerPoisonRow(t *testing.T, f *bfix, ib *inbox.Inbox, h message.NoPublishHandlerFunc) string {
	t.Helper()
	logger := watermill.NopLogger{}
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 1}, logger)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(ib.Poison, ib.Middleware)
	router.AddConsumerHandler("router-h", "orders", pubsub, h)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
		_ = pubsub.Close()
	}()
	<-router.Running()
	msg := outbox.NewMessage([]byte(`{}`))
	if err := pubsub.Publish("orders", msg); err != nil {
		t.Fatal(err)
	}
	waitPoison(t, f, msg.UUID)
	return msg.UUID
}
