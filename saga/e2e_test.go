package saga_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

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
	w := newWorld(t, checkoutDef(t, nil))
	brokers := kafkatest.Brokers(t, 2)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: brokers})
	if err != nil {
		t.Fatal(err)
	}
	r, err := relay.New(relay.Config{Pool: w.db.Pool, Sink: sink, Schema: w.db.Schema, PollInterval: 20 * time.Millisecond,
		Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	relayDone := make(chan error, 1)
	go func() { relayDone <- r.Run(ctx) }()
	orchDone := make(chan error, 1)
	go func() { orchDone <- w.orch.Run(ctx) }()

	var consumersDone []chan error
	if batched {
		consume := func(group string, p inbox.BatchProcessor, topics ...string) {
			c, err := inboxkafka.NewBatchConsumer(inboxkafka.BatchConfig{Brokers: brokers, Group: group, Topics: topics, Processor: p, Logger: quietLogger()})
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- c.Run(ctx) }()
			consumersDone = append(consumersDone, done)
		}
		for _, name := range stepNames {
			p := w.participant(name)
			consume("svc-"+name, saga.ActionProcessor(p, w.action(name)), "cmd."+name)
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
			sub := subscriber("svc-" + name)
			router.AddConsumerHandler(name, "cmd."+name, sub, saga.Action(p, w.action(name)))
			router.AddConsumerHandler("undo-"+name, "undo."+name, sub, saga.Compensation(p, w.compensation(name)))
		}
		for _, topic := range w.orch.ReplyTopics() {
			router.AddConsumerHandler("orchestrator-"+topic, topic, subscriber("orchestrator"), w.orch.Handler)
		}
		routerDone := make(chan error, 1)
		go func() { routerDone <- router.Run(ctx) }()
		<-router.Running()
		consumersDone = append(consumersDone, routerDone)
	}

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
	deadline := time.Now().Add(60 * time.Second)
	for _, id := range ids {
		for {
			d := w.get(id)
			if d.State.Finished() {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("saga %s still %s at step %s (%s)", id, d.State, d.Step, statuses(d))
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
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
	cancel()
	for _, ch := range append([]chan error{relayDone, orchDone}, consumersDone...) {
		if err := <-ch; err != nil {
			t.Error(err)
		}
	}
	_ = sink.Close()
}

// quietLogger keeps the relay's info lines out of the test output.
func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}
