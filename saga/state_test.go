package saga

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
)

type noData struct{}

func testDef(t *testing.T) *Definition[noData] {
	t.Helper()
	cmd := func(noData) (any, error) { return struct{}{}, nil }
	d, err := Define("t", 1, []*StepDef[noData]{
		Step[noData]("a").Send("a", cmd).Compensate("ua", cmd).Attempts(2, time.Second).Timeout(time.Minute),
		Step[noData]("b").Send("b", cmd).Compensate("ub", cmd),
	})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// running returns a saga waiting for the reply to attempt of step a.
func running(attempt int) *instance {
	return &instance{ID: "s", Name: "t", Version: 1, State: StateRunning, Attempt: attempt, Waiting: waitReply,
		Data: []byte(`{}`), Steps: []StepHistory{{Name: "a", Status: stepRunning, Attempts: attempt}, {Name: "b", Status: stepPending}}}
}

// Events that must change nothing, each with the reason logged.
func TestMachineIgnores(t *testing.T) {
	t.Parallel()
	def := testDef(t)
	reply := func(step string, phase outbox.SagaPhase, attempt int, outcome string) event {
		return event{reply: &replyEvent{Step: step, Phase: phase, Attempt: attempt, Outcome: outcome}}
	}
	cases := []struct {
		name string
		in   *instance
		ev   event
		why  string
	}{
		{"unknown step", running(1), reply("zz", outbox.SagaPhaseAction, 1, outbox.SagaOutcomeDone), "unknown step"},
		{"other step", running(1), reply("b", outbox.SagaPhaseAction, 1, outbox.SagaOutcomeDone), "while the saga is at step"},
		{"compensation while running", running(1), reply("a", outbox.SagaPhaseCompensation, 1, outbox.SagaOutcomeDone), "compensation reply"},
		{"attempt not sent", running(1), reply("a", outbox.SagaPhaseAction, 2, outbox.SagaOutcomeDone), "only 1 were sent"},
		{"late failure", running(2), reply("a", outbox.SagaPhaseAction, 1, outbox.SagaOutcomeFailed), "late failed reply"},
		{"unknown outcome", running(1), reply("a", outbox.SagaPhaseAction, 1, "maybe"), "unknown outcome"},
		{"old timer", running(2), event{timer: &timer{Kind: timerStep, Step: 0, Phase: outbox.SagaPhaseAction, Attempt: 1, Action: actTimeout}}, "is over"},
		{"finished", &instance{ID: "s", State: StateCompleted, Steps: []StepHistory{{Name: "a"}, {Name: "b"}}}, reply("a", outbox.SagaPhaseAction, 1, outbox.SagaOutcomeDone), "after the saga completed"},
		{"retry of a running saga", running(1), event{timer: &timer{Kind: timerOperator, Action: actRetry}}, "not stuck"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := &machine{def: def, now: time.Now(), in: c.in}
			before := *c.in
			if err := m.apply(c.ev); err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(m.fx.stale, c.why) || len(m.fx.commands) != 0 || c.in.State != before.State || c.in.Attempt != before.Attempt {
				t.Fatalf("stale %q (want %q), %d commands, state %s attempt %d", m.fx.stale, c.why, len(m.fx.commands), c.in.State, c.in.Attempt)
			}
		})
	}
}

// A late success of an earlier attempt counts: the effect happened.
func TestMachineLateSuccessOfEarlierAttempt(t *testing.T) {
	t.Parallel()
	in := running(2)
	m := &machine{def: testDef(t), now: time.Now(), in: in}
	if err := m.apply(event{reply: &replyEvent{Step: "a", Phase: outbox.SagaPhaseAction, Attempt: 1, Outcome: outbox.SagaOutcomeDone, Payload: []byte(`{}`)}}); err != nil {
		t.Fatal(err)
	}
	if in.Step != 1 || in.Steps[0].Status != stepDone || len(m.fx.commands) != 1 || outbox.TopicOf(m.fx.commands[0], "") != "b" {
		t.Fatalf("step %d, a %s, %d commands", in.Step, in.Steps[0].Status, len(m.fx.commands))
	}
}

// The pure machine asks for local runs and takes their outcomes: a done remote step leads to
// two local runs in the same transition and then the last remote command; saga.Fail in a local
// step compensates the local step before it (another run) and then the remote one (a command);
// an error sets a re-run timer; a deadline while a local step waits compensates only before it.
func TestMachineLocalSteps(t *testing.T) {
	t.Parallel()
	cmd := func(noData) (any, error) { return struct{}{}, nil }
	fn := func(context.Context, pgx.Tx, *noData) error { return nil }
	def, err := Define("t", 1, []*StepDef[noData]{
		Step[noData]("a").Send("a", cmd).Compensate("ua", cmd),
		Step[noData]("l1").Local(fn).CompensateLocal(fn),
		Step[noData]("l2").Local(fn).Attempts(2, time.Second),
		Step[noData]("b").Send("b", cmd),
	})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	start := func() (*machine, *instance) {
		in := &instance{ID: "s", Name: "t", Version: 1, State: StateRunning, Attempt: 1, Waiting: waitReply, Data: []byte(`{}`),
			Steps: []StepHistory{{Name: "a", Status: stepRunning, Attempts: 1}, {Name: "l1", Local: true}, {Name: "l2", Local: true}, {Name: "b"}}}
		m := &machine{def: def, now: now, in: in}
		if err := m.apply(event{reply: &replyEvent{Step: "a", Phase: outbox.SagaPhaseAction, Attempt: 1, Outcome: outbox.SagaOutcomeDone}}); err != nil {
			t.Fatal(err)
		}
		return m, in
	}
	run := func(m *machine, want localRun, o localOutcome) {
		t.Helper()
		if m.fx.local == nil || *m.fx.local != want {
			t.Fatalf("local run %+v, want %+v", m.fx.local, want)
		}
		r := *m.fx.local
		m.fx.local = nil
		if err := m.local(r, o); err != nil {
			t.Fatal(err)
		}
	}

	m, in := start()
	if len(m.fx.commands) != 0 {
		t.Fatalf("%d commands before the local runs", len(m.fx.commands))
	}
	run(m, localRun{1, outbox.SagaPhaseAction, 1}, localOutcome{Data: []byte(`{}`)})
	run(m, localRun{2, outbox.SagaPhaseAction, 1}, localOutcome{Data: []byte(`{}`)})
	if m.fx.local != nil || len(m.fx.commands) != 1 || outbox.TopicOf(m.fx.commands[0], "") != "b" || in.Step != 3 || len(m.fx.ran) != 2 {
		t.Fatalf("after the local runs: local %+v, %d commands, step %d, ran %v", m.fx.local, len(m.fx.commands), in.Step, m.fx.ran)
	}

	m, in = start()
	run(m, localRun{1, outbox.SagaPhaseAction, 1}, localOutcome{Data: []byte(`{}`)})
	run(m, localRun{2, outbox.SagaPhaseAction, 1}, localOutcome{Err: Fail("no")})
	run(m, localRun{1, outbox.SagaPhaseCompensation, 1}, localOutcome{Data: []byte(`{}`)})
	if in.State != StateCompensating || in.Step != 0 || len(m.fx.commands) != 1 || outbox.TopicOf(m.fx.commands[0], "") != "ua" ||
		in.Steps[2].Status != stepFailed || in.Steps[1].Status != stepCompensated {
		t.Fatalf("after Fail: %s at %d, %d commands, steps %+v", in.State, in.Step, len(m.fx.commands), in.Steps)
	}

	m, in = start()
	run(m, localRun{1, outbox.SagaPhaseAction, 1}, localOutcome{Data: []byte(`{}`)})
	run(m, localRun{2, outbox.SagaPhaseAction, 1}, localOutcome{Err: errors.New("locked")})
	if in.Step != 2 || in.Waiting != waitResend || m.fx.setStep == nil || m.fx.setStep.Action != actResend || !m.fx.setStep.Due.Equal(now.Add(time.Second)) ||
		in.Steps[2].LastError != "retry: locked" {
		t.Fatalf("after an error: step %d waiting %s, timer %+v, %+v", in.Step, in.Waiting, m.fx.setStep, in.Steps[2])
	}
	// The deadline while l2 waits to run again: l2 left nothing; l1 and a are compensated.
	m = &machine{def: def, now: now, in: in}
	if err := m.apply(event{timer: &timer{Kind: timerDeadline, Action: actDeadline}}); err != nil {
		t.Fatal(err)
	}
	run(m, localRun{1, outbox.SagaPhaseCompensation, 1}, localOutcome{Data: []byte(`{}`)})
	if in.Steps[2].Uncertain || in.Steps[2].Status != stepFailed || len(m.fx.commands) != 1 || outbox.TopicOf(m.fx.commands[0], "") != "ua" {
		t.Fatalf("after the deadline: steps %+v, %d commands", in.Steps, len(m.fx.commands))
	}
}
