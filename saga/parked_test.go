package saga_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
	"github.com/onceflow/onceflow/saga"
	"github.com/onceflow/onceflow/saga/sagatest"
)

// checkoutV2 is version 2 of checkoutDef: a step ship (cmd.ship, compensated by undo.ship)
// between charge and confirm. Its replies go to the same topic as version 1's.
func checkoutV2(t testing.TB, mod func(name string, s *saga.StepDef[Checkout])) *saga.Definition[Checkout] {
	var steps []*saga.StepDef[Checkout]
	for _, name := range []string{"reserve", "charge", "ship", "confirm"} {
		s := checkoutStep(name)
		if mod != nil {
			mod(name, s)
		}
		steps = append(steps, s)
	}
	def, err := saga.Define("checkout", 2, steps)
	if err != nil {
		t.Fatal(err)
	}
	return def
}

// startOn starts a saga of def for order in its own committed transaction.
func (w *world) startOn(def *saga.Definition[Checkout], order string) string {
	w.t.Helper()
	var id string
	err := pgx.BeginFunc(context.Background(), w.db.Pool, func(tx pgx.Tx) error {
		var err error
		id, err = saga.StartTx(context.Background(), tx, def, Checkout{Order: order, Amount: 42},
			saga.WithID(order), saga.WithWriter(w.writer()), saga.WithMetrics(w.metrics))
		return err
	})
	if err != nil {
		w.t.Fatal(err)
	}
	return id
}

// orchestratorOf is an orchestrator of the world's schema with its own metrics and the given
// definitions registered.
func (w *world) orchestratorOf(m saga.Metrics, defs ...*saga.Definition[Checkout]) *saga.Orchestrator {
	w.t.Helper()
	o, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: w.db.Pool, Schema: w.db.Schema, Metrics: m,
		TimerInterval: 20 * time.Millisecond, Logger: quietLogger()})
	if err != nil {
		w.t.Fatal(err)
	}
	for _, d := range defs {
		if err := saga.Register(o, d); err != nil {
			w.t.Fatal(err)
		}
	}
	return o
}

// The rolling deploy: orchestrator A has only version 1 of the checkout saga, B has
// versions 1 and 2; both consume the reply topic in one consumer group through Kafka (kfake),
// each with its timer loop (Run). 200 sagas of each version run, and A is stopped once half of
// them finished. Every saga completes on the version it started with — a version-2 saga
// through its extra step — and none is stuck or compensated: the version-2 replies that
// reached A were parked there and applied by B, in order, not given up.
func TestRollingDeployVersionsSideBySide(t *testing.T) {
	t.Parallel()
	const perVersion = 200
	v1, v2 := checkoutDef(t, nil), checkoutV2(t, nil)
	w := newWorldMode(t, true, v1)
	brokers := kafkatest.Brokers(t, 2)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// done holds, per goroutine still to wait for, what it runs and where its error arrives.
	done := map[string]chan error{}
	goRun := func(ctx context.Context, what string, run func(context.Context) error) {
		ch := make(chan error, 1)
		go func() { ch <- run(ctx) }()
		done[what] = ch
	}
	wait := func(what string) {
		if err := <-done[what]; err != nil {
			t.Errorf("%s: %v", what, err)
		}
		delete(done, what)
	}
	consume := func(ctx context.Context, what, group string, p inbox.BatchProcessor, topics ...string) {
		c, err := inboxkafka.NewBatchConsumer(inboxkafka.BatchConfig{Brokers: brokers, Group: group, Topics: topics, Processor: p,
			MaxAttempts: 1, Backoff: 10 * time.Millisecond, Logger: quietLogger()})
		if err != nil {
			t.Fatal(err)
		}
		goRun(ctx, what, c.Run)
	}
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: brokers})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sink.Close() }()
	r, err := relay.New(relay.Config{Pool: w.db.Pool, Sink: sink, Schema: w.db.Schema, PollInterval: 20 * time.Millisecond, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	goRun(ctx, "relay", r.Run)
	for _, name := range []string{"reserve", "charge", "ship", "confirm"} {
		p := w.participant(name)
		consume(ctx, "svc-"+name, "svc-"+name, saga.ActionProcessor(p, w.action(name)), "cmd."+name)
		consume(ctx, "undo-"+name, "undo-"+name, saga.CompensationProcessor(p, w.compensation(name)), "undo."+name)
	}
	metricsA, metricsB := &saga.Counters{}, &saga.Counters{}
	a, b := w.orchestratorOf(metricsA, v1), w.orchestratorOf(metricsB, v1, v2)
	if !slices.Equal(a.ReplyTopics(), b.ReplyTopics()) {
		t.Fatalf("reply topics %v and %v: the versions must share one", a.ReplyTopics(), b.ReplyTopics())
	}
	ctxA, stopA := context.WithCancel(ctx)
	defer stopA()
	countA, countB := &countingProcessor{BatchProcessor: a}, &countingProcessor{BatchProcessor: b}
	consume(ctxA, "orchestrator A's consumer", "orchestrator", countA, a.ReplyTopics()...)
	goRun(ctxA, "orchestrator A's Run", a.Run)
	consume(ctx, "orchestrator B's consumer", "orchestrator", countB, b.ReplyTopics()...)
	goRun(ctx, "orchestrator B's Run", b.Run)

	finished := func() int {
		return w.count(`SELECT count(*) FROM ` + w.db.Schema + `.saga WHERE state IN ('completed', 'compensated', 'stuck')`)
	}
	states := func() string {
		rows, err := w.db.Pool.Query(context.Background(), `SELECT version || '/' || state, count(*) FROM `+w.db.Schema+`.saga GROUP BY 1 ORDER BY 1`)
		if err != nil {
			return err.Error()
		}
		defer rows.Close()
		var out []string
		for rows.Next() {
			var s string
			var n int
			if err := rows.Scan(&s, &n); err != nil {
				return err.Error()
			}
			out = append(out, fmt.Sprintf("%s: %d", s, n))
		}
		return fmt.Sprintf("replies handed to A: %d, to B: %d; sagas by version/state: %s", countA.n.Load(), countB.n.Load(), strings.Join(out, ", "))
	}
	versionOf := map[string]int{}
	var ids []string
	start := func(i int) {
		for _, def := range []*saga.Definition[Checkout]{v1, v2} {
			id := w.startOn(def, fmt.Sprintf("v%d-%03d", def.Version(), i))
			ids = append(ids, id)
			versionOf[id] = def.Version()
		}
	}
	// One saga of each version at a time until both orchestrators have been handed replies:
	// both are in the group, each holding a partition of the reply topic.
	i := 0
	for ; i < perVersion && (countA.n.Load() == 0 || countB.n.Load() == 0); i++ {
		handed := countA.n.Load() + countB.n.Load()
		start(i)
		testutil.AwaitWithin(t, 30*time.Second, "a reply handed to an orchestrator", func() bool { return countA.n.Load()+countB.n.Load() > handed }, states)
	}
	for ; i < perVersion; i++ {
		start(i)
	}
	testutil.AwaitWithin(t, 60*time.Second, "half of the sagas finished", func() bool { return finished() >= perVersion }, states)
	stopA()
	wait("orchestrator A's consumer")
	wait("orchestrator A's Run")
	testutil.AwaitWithin(t, 60*time.Second, "every saga finished", func() bool { return finished() == 2*perVersion }, states)
	cancel()
	for what := range done {
		wait(what)
	}

	for _, id := range ids {
		d := w.get(id)
		want := []string{"reserve/action", "charge/action", "confirm/action"}
		if versionOf[id] == 2 {
			want = []string{"reserve/action", "charge/action", "ship/action", "confirm/action"}
		}
		if fx := w.effects(id); d.State != saga.StateCompleted || d.Version != versionOf[id] || !slices.Equal(fx, want) {
			t.Errorf("saga %s (v%d): %s on v%d with effects %v (error %q); want completed with %v", id, versionOf[id], d.State, d.Version, fx, d.Error, want)
		}
	}
	if n := w.count(`SELECT count(*) FROM ` + w.db.Schema + `.inbox_poison`); n != 0 {
		t.Errorf("%d messages given up as poison, want none", n)
	}
	if n := w.count(`SELECT count(*) FROM ` + w.db.Schema + `.saga_parked`); n != 0 {
		t.Errorf("%d replies still parked, want none", n)
	}
	if s := metricsA.Snapshot(); s.AwaitingVersion == 0 {
		t.Errorf("orchestrator A parked no reply (metrics %+v): no version-2 reply reached it, so the test tested nothing", s)
	}
	if s := metricsB.Snapshot(); s.AwaitingVersion != 0 {
		t.Errorf("orchestrator B, which has both versions, parked %d replies for lack of a version", s.AwaitingVersion)
	}
	for who, m := range map[string]*saga.Counters{"A": metricsA, "B": metricsB} {
		if s := m.Snapshot(); s.Stuck != 0 || s.Compensated != 0 {
			t.Errorf("orchestrator %s's metrics %+v: want no stuck and no compensated saga", who, s)
		}
	}
	t.Logf("replies handed to A: %d, to B: %d; A parked %d, completed %d sagas; B completed %d", countA.n.Load(), countB.n.Load(),
		metricsA.Snapshot().AwaitingVersion, metricsA.Snapshot().Completed, metricsB.Snapshot().Completed)
}

// countingProcessor counts the messages handed to a BatchProcessor.
type countingProcessor struct {
	inbox.BatchProcessor
	n atomic.Int64
}

// ProcessBatch implements inbox.BatchProcessor.
func (c *countingProcessor) ProcessBatch(ctx context.Context, msgs []*message.Message) error {
	c.n.Add(int64(len(msgs)))
	return c.BatchProcessor.ProcessBatch(ctx, msgs)
}

// A reply of a saga whose definition version the orchestrator lacks is parked, in the batch
// that also applies another saga's reply: no attempt counted, no saga stuck, nothing given
// up. The saga shows what it awaits. Once an orchestrator with the version runs, it applies
// the parked reply and the saga goes on to its end.
func TestReplyOfAnUnregisteredVersionParks(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		ctx := context.Background()
		v1, v2 := checkoutDef(t, nil), checkoutV2(t, nil)
		w := newWorldMode(t, batched, v1) // w.orch has version 1 only
		w.subscribeParticipant("ship", true)
		x, y := w.startOn(v2, "x-v2"), w.startOn(v1, "y-v1")
		w.runUntil(y, saga.StateCompleted)

		d := w.get(x)
		if d.State != saga.StateRunning || d.Step != "reserve" || d.ParkedReplies != 1 || d.AwaitingVersion != 2 {
			t.Fatalf("saga %s: %s at %s with %d parked replies awaiting version %d; want running at reserve, 1 parked, awaiting 2",
				x, d.State, d.Step, d.ParkedReplies, d.AwaitingVersion)
		}
		if wt := d.Wait; wt == nil || wt.For != saga.WaitVersion || wt.Definition != "checkout" || wt.Version != 2 || wt.Parked != 1 || wt.Since.IsZero() {
			t.Fatalf("saga %s waits for %+v; want an orchestrator with checkout version 2", x, wt)
		}
		if s := w.metrics.Snapshot(); s.AwaitingVersion != 1 || s.Stuck != 0 {
			t.Fatalf("metrics %+v: want 1 reply awaiting a version, no saga stuck", s)
		}
		if n := w.count(`SELECT count(*) FROM ` + w.db.Schema + `.inbox_poison`); n != 0 {
			t.Fatalf("%d messages given up, want none", n)
		}
		admin := w.admin()
		byVersion, err := admin.ParkedByVersion(ctx, w.db.Pool)
		if err != nil {
			t.Fatal(err)
		}
		if len(byVersion) != 1 || byVersion[0].Name != "checkout" || byVersion[0].Version != 2 || byVersion[0].Replies != 1 || byVersion[0].Sagas != 1 {
			t.Fatalf("parked by version %+v; want 1 reply of 1 checkout v2 saga", byVersion)
		}

		// The deploy goes on: B, with both versions, replaces A.
		metricsB := &saga.Counters{}
		b := w.orchestratorOf(metricsB, v1, v2)
		w.bus = sagatest.NewBus(w.db.Pool, w.db.Schema)
		for _, name := range []string{"reserve", "charge", "ship", "confirm"} {
			w.subscribeParticipant(name, true)
		}
		w.orchestrate(b)
		d = w.runUntil(x, saga.StateCompleted)
		if got := strings.Join(w.effects(x), " "); got != "reserve/action charge/action ship/action confirm/action" || d.ParkedReplies != 0 {
			t.Fatalf("saga %s: effects %q, %d parked replies; want version 2's four steps, none parked", x, got, d.ParkedReplies)
		}
		if s := metricsB.Snapshot(); s.AwaitingVersion != 0 || s.Completed != 1 {
			t.Fatalf("B's metrics %+v: want x completed, nothing parked", s)
		}
	})
}

// replyOf is a participant's done reply to attempt of step's action of saga id.
func replyOf(id, step string, attempt int, payload string) *message.Message {
	msg := message.NewMessage(uuid.NewString(), []byte(payload))
	outbox.SetSaga(msg, outbox.SagaRef{ID: id, Step: step, Phase: outbox.SagaPhaseAction, Attempt: attempt})
	msg.Metadata.Set(outbox.MetadataSagaOutcome, outbox.SagaOutcomeDone)
	msg.Metadata.Set(outbox.MetadataSagaName, "checkout")
	return msg
}

// A saga's replies are applied in the order they arrived, across orchestrators: a reply that
// reaches B (which has the version) while an earlier one waits parked (A lacked the version)
// parks behind it, and B's re-drive applies both, in order. Applied out of order, the later
// reply (charge's, while the saga is at reserve) would be dropped as stale. A redelivered
// reply parks once, and a redelivery after the re-drive is a duplicate.
func TestParkedRepliesAreAppliedInOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v1, v2 := checkoutDef(t, nil), checkoutV2(t, nil)
	w := newWorld(t, v1, "reserve", "charge", "confirm") // no bus runs: replies are handed over by hand
	a, b := w.orchestratorOf(&saga.Counters{}, v1), w.orchestratorOf(&saga.Counters{}, v1, v2)
	x, y := w.startOn(v2, "x-v2"), w.startOn(v1, "y-v1")
	reserved, charged := replyOf(x, "reserve", 1, `{"id":"r-1"}`), replyOf(x, "charge", 1, `{"id":"p-1"}`)

	if err := a.ProcessBatch(ctx, []*message.Message{reserved, reserved.Copy()}); err != nil {
		t.Fatal(err)
	}
	if err := b.ProcessBatch(ctx, []*message.Message{charged, replyOf(y, "reserve", 1, `{"id":"r-y"}`)}); err != nil {
		t.Fatal(err)
	}
	if n := w.count(`SELECT count(*) FROM `+w.db.Schema+`.saga_parked WHERE saga_id = $1`, x); n != 2 {
		t.Fatalf("%d parked replies of %s, want 2: reserve's once (redelivered), charge's behind it", n, x)
	}
	if d := w.get(x); d.Step != "reserve" || d.ParkedReplies != 2 {
		t.Fatalf("saga %s at %s with %d parked replies; want still at reserve with 2", x, d.Step, d.ParkedReplies)
	}
	if d := w.get(y); d.Step != "charge" {
		t.Fatalf("saga %s at %s; want at charge: B applied its reply in the batch that parked x's", y, d.Step)
	}
	if n, err := a.RedriveParked(ctx); err != nil || n != 0 {
		t.Fatalf("A (version 1 only) re-drove %d parked replies (err %v), want none", n, err)
	}
	if n, err := b.RedriveParked(ctx); err != nil || n != 2 {
		t.Fatalf("B re-drove %d parked replies (err %v), want 2", n, err)
	}
	d := w.get(x)
	var data Checkout
	if err := json.Unmarshal(d.Data, &data); err != nil {
		t.Fatal(err)
	}
	if d.Step != "ship" || data.ReservationID != "r-1" || data.PaymentID != "p-1" || d.ParkedReplies != 0 || d.Wait == nil || d.Wait.For == saga.WaitVersion {
		t.Fatalf("saga %s at %s with data %+v, %d parked, waiting %+v; want at ship after reserve's and charge's replies, none parked",
			x, d.Step, data, d.ParkedReplies, d.Wait)
	}
	if err := b.ProcessBatch(ctx, []*message.Message{reserved.Copy()}); err != nil {
		t.Fatal(err)
	}
	if after := w.get(x); after.Step != "ship" || len(after.Steps[0].Replies) != 1 || after.ParkedReplies != 0 {
		t.Fatalf("a redelivery after the re-drive changed saga %s: at %s, %d replies of reserve, %d parked", x, after.Step, len(after.Steps[0].Replies), after.ParkedReplies)
	}
}

// A parked reply whose transition fails at the orchestrator that has the version is tried
// again in the next rounds, its error shown with the saga; after MaxAttempts its saga is set
// stuck and the reply given up, as a reply handed over by a consumer would be.
func TestParkedReplyThatKeepsFailingSetsItsSagaStuck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v1 := checkoutDef(t, nil)
	v2 := checkoutV2(t, func(name string, s *saga.StepDef[Checkout]) {
		if name == "reserve" {
			s.OnReply(func(*Checkout, saga.Reply) error { panic("reserve's reply handler is broken") })
		}
	})
	w := newWorld(t, v1, "reserve", "charge", "confirm")
	a := w.orchestratorOf(&saga.Counters{}, v1)
	metricsB := &saga.Counters{}
	b, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: w.db.Pool, Schema: w.db.Schema, Metrics: metricsB, MaxAttempts: 2, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	if err := saga.Register(b, v2); err != nil {
		t.Fatal(err)
	}
	x := w.startOn(v2, "x-v2")
	if err := a.ProcessBatch(ctx, []*message.Message{replyOf(x, "reserve", 1, `{"id":"r-1"}`)}); err != nil {
		t.Fatal(err)
	}
	if n, err := b.RedriveParked(ctx); err != nil || n != 0 {
		t.Fatalf("B re-drove %d (err %v), want 0: the transition fails", n, err)
	}
	d := w.get(x)
	if d.State != saga.StateRunning || d.ParkedReplies != 1 || d.Wait == nil || d.Wait.For != saga.WaitVersion || !strings.Contains(d.Wait.LastError, "broken") {
		t.Fatalf("after one failure saga %s is %s with %d parked, waiting %+v; want running, 1 parked, the error shown", x, d.State, d.ParkedReplies, d.Wait)
	}
	if n, err := b.RedriveParked(ctx); err != nil || n != 0 {
		t.Fatalf("B re-drove %d (err %v), want 0", n, err)
	}
	d = w.get(x)
	if d.State != saga.StateStuck || d.ParkedReplies != 0 || !strings.Contains(d.Error, "broken") || metricsB.Snapshot().Stuck != 1 {
		t.Fatalf("after MaxAttempts saga %s is %s (%q) with %d parked, B's metrics %+v; want stuck with the error, none parked",
			x, d.State, d.Error, d.ParkedReplies, metricsB.Snapshot())
	}
	if n := w.count(`SELECT count(*) FROM ` + w.db.Schema + `.inbox_poison WHERE replay_refusal LIKE '%saga retry%'`); n != 1 {
		t.Fatalf("%d poison rows refusing a replay, want the given-up reply's", n)
	}
}

// A timer of a saga whose definition version the orchestrator lacks is left for an
// orchestrator that has it: not fired, not postponed, nothing logged as an error; the other
// orchestrator fires it.
func TestTimerOfAnUnregisteredVersionWaits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const timeout = 100 * time.Millisecond
	v1 := timeoutDef(t, timeout)
	v2 := checkoutV2(t, func(name string, s *saga.StepDef[Checkout]) {
		if name == "reserve" {
			s.Attempts(2, time.Millisecond).Timeout(timeout)
		}
	})
	w := newWorld(t, v1, "reserve")
	var logA testutil.SyncBuffer
	a, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: w.db.Pool, Schema: w.db.Schema, Logger: slog.New(slog.NewTextHandler(&logA, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if err := saga.Register(a, v1); err != nil {
		t.Fatal(err)
	}
	// B has version 2 only, so it cannot fire u's next timeout, due 100 ms after A fired the
	// first one, when this slow machine takes that long to get to B.
	b := w.orchestratorOf(&saga.Counters{}, v2)
	u, x := w.startOn(v1, "u-v1"), w.startOn(v2, "x-v2")
	timers := `SELECT count(*) FROM ` + w.db.Schema + `.saga_timer WHERE due_at <= now()`
	testutil.AwaitWithin(t, 10*time.Second, "both step timers due", func() bool { return w.count(timers) == 2 }, func() string { return "" })
	dueOf := func() time.Time {
		var due time.Time
		if err := w.db.Pool.QueryRow(ctx, `SELECT due_at FROM `+w.db.Schema+`.saga_timer WHERE saga_id = $1`, x).Scan(&due); err != nil {
			t.Fatal(err)
		}
		return due
	}
	due := dueOf()
	for range 2 {
		if n, err := a.FireDue(ctx); err != nil || n > 1 {
			t.Fatalf("A fired %d timers (err %v), want at most u's", n, err)
		}
	}
	if got := w.attemptsSent(u); got["2"] != 1 {
		t.Fatalf("A did not fire the timer of its own version's saga: commands per attempt %v", got)
	}
	if got := w.attemptsSent(x); got["2"] != 0 || !dueOf().Equal(due) {
		t.Fatalf("A touched version 2's timer: commands per attempt %v, due %s (was %s)", got, dueOf(), due)
	}
	if log := logA.String(); strings.Contains(log, "level=ERROR") || strings.Contains(log, "postpone") {
		t.Fatalf("A logged about a timer it does not have the version of:\n%s", log)
	}
	if n, err := b.FireDue(ctx); err != nil || n != 1 {
		t.Fatalf("B fired %d timers (err %v), want x's", n, err)
	}
	if got := w.attemptsSent(x); got["2"] != 1 {
		t.Fatalf("B fired x's timeout, yet commands per attempt %v; want attempt 2 sent", got)
	}
}
