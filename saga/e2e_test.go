package saga_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
	"github.com/onceflow/onceflow/saga"
)

// The whole path: sagas started in business transactions, commands and replies through the
// outbox, the relay (franz-go to kfake) and watermill-kafka subscribers into the participants
// and the orchestrator. Some sagas fail at charge and compensate.
func TestEndToEndThroughKafka(t *testing.T) {
	t.Parallel()
	t.Run("per-message", func(t *testing.T) { t.Parallel(); endToEnd(t, false) })
	t.Run("batched", func(t *testing.T) { t.Parallel(); endToEnd(t, true) })
}

// endToEnd runs the consumers either under a Watermill router (watermill-kafka, one message
// at a time) or on inboxkafka.BatchConsumer (ActionProcessor, CompensationProcessor and the
// orchestrator as BatchProcessors).
func endToEnd(t *testing.T, batched bool) {
	w := newWorldMode(t, batched, checkoutDef(t, nil))
	stop := w.throughKafka(kafkatest.Brokers(t, 2))
	defer stop()

	const n = 20
	ids := make([]string, n)
	for i := range ids {
		order := fmt.Sprintf("o-%02d", i)
		if i%4 == 3 {
			w.mu.Lock()
			w.failOrder[order] = "charge"
			w.mu.Unlock()
		}
		ids[i] = w.start(order)
	}
	w.waitFinished(ids, 60*time.Second)
	for i, id := range ids {
		d := w.get(id)
		fx := w.effects(id)
		want, state := []string{"reserve/action", "charge/action", "confirm/action"}, saga.StateCompleted
		if i%4 == 3 {
			want, state = []string{"reserve/action", "reserve/compensation"}, saga.StateCompensated
		}
		if d.State != state || !slices.Equal(fx, want) {
			t.Errorf("saga %s: %s with effects %v, want %s with %v", id, d.State, fx, state, want)
		}
	}
}

// quietLogger keeps the relay's info lines out of the test output.
func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// throughKafka runs the world's saga through the outbox, a relay (franz-go to brokers) and
// Kafka consumers — a Watermill router with watermill-kafka subscribers, or
// inboxkafka.BatchConsumers in a batched world — one consumer group per handler, and the
// orchestrator's timers. stop ends them all and checks they stopped cleanly.
func (w *world) throughKafka(brokers []string) (stop func()) {
	return w.throughKafkaWith(brokers, w.action)
}

// throughKafkaWith is throughKafka with the participants' action handlers of action(name) in
// place of the world's.
func (w *world) throughKafkaWith(brokers []string, action func(name string) func(context.Context, pgx.Tx, stepCmd) (stepResult, error)) (stop func()) {
	t := w.t
	ctx, cancel := context.WithCancel(context.Background())
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: brokers})
	if err != nil {
		t.Fatal(err)
	}
	r, err := relay.New(relay.Config{Pool: w.db.Pool, Sink: sink, Schema: w.db.Schema, PollInterval: 20 * time.Millisecond,
		Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	var done []chan error
	goRun := func(run func(context.Context) error) {
		ch := make(chan error, 1)
		go func() { ch <- run(ctx) }()
		done = append(done, ch)
	}
	goRun(r.Run)
	goRun(w.orch.Run)
	if w.batched {
		consume := func(group string, p inbox.BatchProcessor, topics ...string) {
			c, err := inboxkafka.NewBatchConsumer(inboxkafka.BatchConfig{Brokers: brokers, Group: group, Topics: topics, Processor: p,
				MaxAttempts: max(w.maxAttempts, 1), Backoff: 10 * time.Millisecond, Logger: quietLogger()})
			if err != nil {
				t.Fatal(err)
			}
			goRun(c.Run)
		}
		for _, name := range stepNames {
			p := w.participant(name)
			consume("svc-"+name, saga.ActionProcessor(p, action(name)), "cmd."+name)
			consume("undo-"+name, saga.CompensationProcessor(p, w.compensation(name)), "undo."+name)
		}
		consume("orchestrator", w.orch, w.orch.ReplyTopics()...)
	} else {
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		subscriber := func(group string) message.Subscriber {
			sub, err := kafka.NewSubscriber(inboxkafka.SubscriberConfig(brokers, group), watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			return sub
		}
		for _, name := range stepNames {
			p := w.participant(name)
			router.AddConsumerHandler(name, "cmd."+name, subscriber("svc-"+name), saga.Action(p, action(name)))
			router.AddConsumerHandler("undo-"+name, "undo."+name, subscriber("undo-"+name), saga.Compensation(p, w.compensation(name)))
		}
		for _, topic := range w.orch.ReplyTopics() {
			router.AddConsumerHandler("orchestrator-"+topic, topic, subscriber("orchestrator-"+topic), w.orch.Handler)
		}
		goRun(router.Run)
		<-router.Running()
	}
	return func() {
		cancel()
		for _, ch := range done {
			if err := <-ch; err != nil {
				t.Error(err)
			}
		}
		_ = sink.Close()
	}
}

// waitFinished waits until every saga of ids has finished, failing after limit.
func (w *world) waitFinished(ids []string, limit time.Duration) {
	w.t.Helper()
	deadline := time.Now().Add(limit)
	for _, id := range ids {
		for {
			d := w.get(id)
			if d.State.Finished() {
				break
			}
			if time.Now().After(deadline) {
				w.t.Fatalf("saga %s still %s at step %s (%s) after %s", id, d.State, d.Step, statuses(d), limit)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// A participant whose handler returns an ordinary error (not Fail or Retry) for one saga,
// started first among 200 on a one-partition topic: the command is tried a few times, then
// answered as a failed attempt carrying the error, so the partition moves on and the other
// 199 sagas complete; the broken saga compensates after its attempts, and its error is in
// its history (`onceflow saga show`).
func TestFailingParticipantDoesNotWedgeItsPartition(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		w := newWorldMode(t, batched, checkoutDef(t, nil))
		w.maxAttempts = 2
		stop := w.throughKafka(kafkatest.Brokers(t, 1))
		defer stop()
		w.mu.Lock()
		w.broken["o-000"] = "charge"
		w.mu.Unlock()
		var ids []string
		for i := range 200 {
			ids = append(ids, w.start(fmt.Sprintf("o-%03d", i)))
		}
		w.waitFinished(ids, 90*time.Second)
		for i, id := range ids {
			d := w.get(id)
			if i == 0 {
				if d.State != saga.StateCompensated || !strings.Contains(d.Steps[1].LastError+d.Error, "neither Fail nor Retry") {
					t.Fatalf("broken saga: %s, error %q, charge's last error %q; want compensated with the handler's error", d.State, d.Error, d.Steps[1].LastError)
				}
				if got := strings.Join(w.effects(id), " "); got != "reserve/action reserve/compensation" {
					t.Fatalf("broken saga's effects %q", got)
				}
				continue
			}
			if d.State != saga.StateCompleted {
				t.Fatalf("saga %s: %s (%s)", id, d.State, d.Error)
			}
		}
		if s := w.metrics.Snapshot(); s.StepErrors != 3 { // one per attempt of the step
			t.Fatalf("metrics %+v: want 3 commands answered as failed", s)
		}
	})
}

// A reply whose transition keeps failing (here: its saga row has a corrupt step history)
// started first among 50 on one partition: the reply is tried a few times, then its saga is
// set stuck with the error and the reply recorded as poison, so the reply partition moves on
// and the other sagas complete.
func TestFailingReplyDoesNotWedgeTheOrchestrator(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		w := newWorldMode(t, batched, checkoutDef(t, nil))
		w.maxAttempts = 2
		ids := []string{w.start("o-000")}
		if _, err := w.db.Pool.Exec(context.Background(), `UPDATE `+w.db.Schema+`.saga SET steps = '{"not": "a list"}' WHERE id = 'o-000'`); err != nil {
			t.Fatal(err)
		}
		for i := 1; i < 50; i++ {
			ids = append(ids, w.start(fmt.Sprintf("o-%03d", i)))
		}
		stop := w.throughKafka(kafkatest.Brokers(t, 1))
		defer stop()
		w.waitFinished(ids[1:], 90*time.Second)
		deadline := time.Now().Add(60 * time.Second)
		var state, reason string
		for state != string(saga.StateStuck) {
			if time.Now().After(deadline) {
				t.Fatalf("the unreadable saga is %q (%q), want stuck", state, reason)
			}
			time.Sleep(20 * time.Millisecond)
			if err := w.db.Pool.QueryRow(context.Background(), `SELECT state, error FROM `+w.db.Schema+`.saga WHERE id = 'o-000'`).Scan(&state, &reason); err != nil {
				t.Fatal(err)
			}
		}
		if !strings.Contains(reason, "corrupt step history") {
			t.Fatalf("stuck with error %q, want the transition's error", reason)
		}
		if n := w.count(`SELECT count(*) FROM ` + w.db.Schema + `.inbox_poison WHERE consumer = 'onceflow-saga'`); n != 1 {
			t.Fatalf("%d poison rows for the reply, want 1", n)
		}
	})
}
