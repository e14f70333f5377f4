package saga

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/internal/engine"
	"github.com/onceflow/onceflow/internal/failure"
	"github.com/onceflow/onceflow/outbox"
)

// State is where a saga is in its life. A saga is running until its last step succeeds
// (completed) or a step fails for a business reason, runs out of attempts, times out or hits
// the saga deadline, after which it compensates the steps that took effect, last first
// (compensating, then compensated). A compensation that keeps failing stops the saga in
// stuck, with its error, until an operator resumes it (`onceflow saga retry`).
type State string

// The saga states.
const (
	StateRunning      State = "running"
	StateCompensating State = "compensating"
	StateCompleted    State = "completed"
	StateCompensated  State = "compensated"
	StateStuck        State = "stuck"
)

// Finished reports whether the saga has ended (completed or compensated).
func (s State) Finished() bool { return s == StateCompleted || s == StateCompensated }

// Step statuses, as shown by `onceflow saga show`.
const (
	stepPending      = "pending"      // not reached
	stepRunning      = "running"      // command sent, waiting for the reply or a re-send (local: waiting to run again)
	stepDone         = "done"         // the action took effect
	stepFailed       = "failed"       // the action failed (no effect, or an unknown one when uncertain)
	stepCompensating = "compensating" // compensation sent
	stepCompensated  = "compensated"  // compensation took effect (or was a no-op: the action never ran)
	stepKept         = "kept"         // took effect and has no compensation
)

// waiting says what a saga in flight waits for.
const (
	waitReply  = "reply"  // the reply to the current attempt
	waitResend = "resend" // the backoff before re-sending the command (local: running it again)
	waitRun    = "run"    // a local first step's run, due at once after the start (actRun)
)

// instance is one saga's row: its state and history.
type instance struct {
	ID        string
	Name      string
	Version   int
	State     State
	Step      int    // index of the current step (being run or compensated)
	Attempt   int    // the current attempt of the current step's phase
	Budget    int    // attempts before the current budget (an operator's retry starts a new one)
	Waiting   string // waitReply or waitResend
	Data      json.RawMessage
	Steps     []StepHistory
	Error     string
	CreatedAt time.Time
	UpdatedAt time.Time
	// Trace is the W3C trace context StartTx's caller was in (see startTimer).
	Trace map[string]string
	// wrote is the event id of the last command this transaction's transitions wrote for the
	// saga ("" when none): stored with the row, with the transaction's id, as where the
	// command is in the outbox (store.update, wait.go). Not read back: a row is loaded in the
	// transaction that changes it, so the field starts empty in each.
	wrote string
}

// StepHistory is the history of one step of a saga, stored as JSON with it and shown by
// `onceflow saga show`.
type StepHistory struct {
	// Name is the step's name in the definition.
	Name string `json:"name"`
	// Local is set for a local step: its action runs in the orchestrator's transaction
	// (Attempts counts its runs; it sends no commands).
	Local bool `json:"local,omitempty"`
	// LocalCompensation is set when the step's compensation is local (CompensateLocal).
	LocalCompensation bool `json:"local_compensation,omitempty"`
	// Status is pending, running, done, failed, compensating, compensated or kept (took
	// effect and has no compensation).
	Status string `json:"status"`
	// Attempts and CompAttempts count the action and compensation commands sent (or, for a
	// local action or compensation, its runs).
	Attempts     int `json:"attempts,omitempty"`
	CompAttempts int `json:"comp_attempts,omitempty"`
	// Pivot marks the definition's pivot step, recorded when the saga starts: from it on the
	// saga only goes forward, and an Admin that does not know the definition can still refuse
	// a compensation past it.
	Pivot bool `json:"pivot,omitempty"`
	// TookEffect is set once a participant answered the action done, even when that reply
	// could not be applied (the saga went stuck): the step's later commands say so
	// (outbox.MetadataSagaTookEffect), so a participant whose barrier record of the action is
	// missing neither runs it again nor takes a compensation for a null one.
	TookEffect bool `json:"took_effect,omitempty"`
	// Uncertain is set when an attempt timed out (or a deadline or operator interrupted it):
	// its effect is unknown, so the step is compensated too (a no-op if it never ran).
	Uncertain bool `json:"uncertain,omitempty"`
	// LastError is the last failure reported for the step.
	LastError string `json:"last_error,omitempty"`
	// Sent lists the commands written to the outbox, in order.
	Sent []SentCommand `json:"sent,omitempty"`
	// Replies lists the participants' replies the saga applied, in order (a duplicate or a
	// stale reply changes nothing and is not listed).
	Replies    []ReceivedReply `json:"replies,omitempty"`
	StartedAt  *time.Time      `json:"started_at,omitempty"`
	FinishedAt *time.Time      `json:"finished_at,omitempty"`
	// SentAs is the step name the step's commands carry — the participants' dedup and barrier
	// keys — when it is not Name: an upgrade renamed the step after it had sent commands, and
	// its later commands (a re-send, its compensation) keep the name its participant knows it
	// by. Empty when the commands carry Name.
	SentAs string `json:"sent_as,omitempty"`
	// Upgrades records the upgrades of the saga to a newer definition version made at this
	// step, and the ones refused there (upgrade.go; Detail.Upgrades lists them all).
	Upgrades []UpgradeRecord `json:"upgrades,omitempty"`
}

// SentCommand records a command the saga wrote to the outbox.
type SentCommand struct {
	// Phase, Attempt: which command; Topic and EventID: where it went, with which event id.
	Phase   outbox.SagaPhase `json:"phase"`
	Attempt int              `json:"attempt"`
	Topic   string           `json:"topic"`
	EventID string           `json:"event_id"`
	At      time.Time        `json:"at"`
}

// ReceivedReply records a participant's reply the saga applied.
type ReceivedReply struct {
	// Phase and Attempt: which command it answered; Outcome: done, failed or retry (see
	// outbox.SagaOutcomeDone), with the participant's Reason for a failure (at most
	// maxReplyReason bytes); EventID: the reply's own event id.
	Phase   outbox.SagaPhase `json:"phase"`
	Attempt int              `json:"attempt"`
	Outcome string           `json:"outcome"`
	Reason  string           `json:"reason,omitempty"`
	EventID string           `json:"event_id"`
	At      time.Time        `json:"at"`
}

// maxReplyReason bounds what the history keeps of a failure's reason per reply: the step's
// LastError has the latest in full, and a saga row must not grow by a stack trace per attempt.
const maxReplyReason = 500

// afterAttempts counts the attempts of the current phase the way the command metadata and
// `onceflow saga show` do (every command sent), and the ones since an operator's retry.
func (in *instance) afterAttempts() string {
	n := fmt.Sprintf("after %d attempts", in.Attempt)
	if in.Attempt == 1 {
		n = "after 1 attempt"
	}
	if in.Budget > 0 {
		return fmt.Sprintf("%s, %d of them since `onceflow saga retry`", n, in.Attempt-in.Budget)
	}
	return n
}

// stuckPhase is the phase a stuck saga was in when it stopped: compensation when its current
// step was being compensated, else action (it was moving forward).
func (in *instance) stuckPhase() outbox.SagaPhase {
	if in.Step < len(in.Steps) && in.Steps[in.Step].Status == stepCompensating {
		return outbox.SagaPhaseCompensation
	}
	return outbox.SagaPhaseAction
}

func (in *instance) phase() outbox.SagaPhase {
	if in.State == StateRunning {
		return outbox.SagaPhaseAction
	}
	return outbox.SagaPhaseCompensation
}

// timer kinds: one per saga and kind (the primary key of saga_timer).
const (
	timerStep     = "step"     // a step's timeout or re-send backoff
	timerDeadline = "deadline" // the saga-wide deadline
	timerOperator = "operator" // an operator's request (retry, compensate), due at once
)

// Timer actions.
const (
	actTimeout    = "timeout"
	actResend     = "resend"
	actDeadline   = "deadline"
	actRetry      = "retry"
	actCompensate = "compensate"
	actRun        = "run" // run a local first step (StartTx without RunLocalSteps)
)

// timer is a saga_timer row.
type timer struct {
	Kind    string
	Step    int
	Phase   outbox.SagaPhase
	Attempt int
	Action  string
	Due     time.Time
}

// event is what drives a transition: a reply, a due timer or an operator's request.
type event struct {
	reply *replyEvent
	timer *timer
}

// localRun is a machine's request to run a local step's phase: the store layer runs it in
// the transition's transaction and feeds the outcome back with machine.local.
type localRun struct {
	Step    int
	Phase   outbox.SagaPhase
	Attempt int
}

// localOutcome is how a local step's run ended: Data is the saga data after it (on success),
// Err what it returned (saga.Fail: a business failure; anything else: retried).
type localOutcome struct {
	Data json.RawMessage
	Err  error
}

type replyEvent struct {
	EventID string // the reply message's id
	Step    string
	Phase   outbox.SagaPhase
	Attempt int
	Outcome string
	Reason  string
	Payload []byte
	// RetryAfter is the wait a participant asked for (inbox.RetryAfter) on a retry reply.
	RetryAfter time.Duration
}

// effects is what a transition asks the store to do in the same transaction.
type effects struct {
	commands   []*message.Message // written to the outbox
	setStep    *timer             // upsert the step timer
	cancelStep bool               // delete the step timer
	cancelAll  bool               // the saga ended: delete every timer
	stale      string             // the event changed nothing; why (for logs and metrics)
	// hadStepTimer and hadDeadline say whether those timers existed before the transition,
	// so that cancelling a timer that is not there costs no statement.
	hadStepTimer, hadDeadline bool
	finished                  State // StateCompleted or StateCompensated when the saga ended now
	becameStuck               bool
	// local, when set, asks for a local step to run now, in this transition; the caller runs
	// it and calls machine.local with its outcome (which may ask for the next one).
	local *localRun
	// ran lists the local runs of this transition and how they ended (for metrics and
	// tracing, after the commit).
	ran []localNote
}

// localNote is a local run that ended: its step, phase and outcome (done, failed or retry).
type localNote struct {
	Step    string
	Phase   outbox.SagaPhase
	Outcome string
}

// machine applies events to a saga of one definition. It is pure: no I/O, the clock is given.
type machine struct {
	def definition
	now time.Time
	in  *instance
	fx  effects
	// replyTx runs a step's OnReplyTx handler in the transition's transaction; the store
	// layer sets it (runReplyTx). An error it wraps in transitionError fails the transition.
	replyTx func(idx int, data json.RawMessage, r Reply) (json.RawMessage, error)
	// askedAfter is the wait the step's handler asked for (inbox.RetryAfter): a re-send
	// waits at least that long.
	askedAfter time.Duration
}

// transitionError is a reply handler's error that is not the step's failure (a transient
// database error, the context's end): the transition fails and is tried again.
type transitionError struct{ err error }

func (e transitionError) Error() string { return e.err.Error() }
func (e transitionError) Unwrap() error { return e.err }

// apply runs one event. An error means the transition could not be computed (a corrupt row, a
// definition that no longer matches it); the caller fails the message or timer and retries.
func (m *machine) apply(ev event) error {
	in := m.in
	live := in.State == StateRunning || in.State == StateCompensating
	m.fx.hadStepTimer = live && (in.Waiting == waitResend || in.Waiting == waitRun || (in.Waiting == waitReply && m.def.step(in.Step).timeout > 0))
	m.fx.hadDeadline = in.State == StateRunning && m.def.deadline() > 0
	if ev.timer != nil {
		// The firing transaction deleted the timer already.
		m.fx.hadStepTimer = m.fx.hadStepTimer && ev.timer.Kind != timerStep
		m.fx.hadDeadline = m.fx.hadDeadline && ev.timer.Kind != timerDeadline
	}
	switch {
	case ev.reply != nil:
		return m.onReply(*ev.reply)
	case ev.timer != nil:
		return m.onTimer(*ev.timer)
	}
	return fmt.Errorf("saga: empty event")
}

// local feeds back the outcome of the local run the machine asked for (fx.local), which the
// caller cleared. It changes the saga as a reply would: success goes on (to the next step, a
// remote one's command or another local run), saga.Fail fails the step, anything else is
// retried after the backoff, within the step's (or the compensation's) attempts.
func (m *machine) local(r localRun, o localOutcome) error {
	in := m.in
	if in.Step != r.Step || in.phase() != r.Phase || in.Attempt != r.Attempt {
		return fmt.Errorf("saga: a local run of step %d (%s, attempt %d) does not match the saga (step %d, %s, attempt %d)",
			r.Step, r.Phase, r.Attempt, in.Step, in.phase(), in.Attempt)
	}
	outcome, reason := outbox.SagaOutcomeDone, ""
	switch oe := outcomeOf(o.Err); {
	case oe != nil:
		outcome, reason = oe.outcome, oe.reason
		m.askedAfter = oe.after
	case o.Err != nil:
		outcome, reason = outbox.SagaOutcomeRetry, o.Err.Error()
	default:
		in.Data = o.Data
	}
	m.fx.ran = append(m.fx.ran, localNote{Step: m.def.step(r.Step).name, Phase: r.Phase, Outcome: outcome})
	return m.outcome(r.Step, r.Phase, outcome, reason, nil, r.Attempt)
}

func (m *machine) stale(why string) error {
	m.fx.stale = why
	return nil
}

func (m *machine) onReply(r replyEvent) error {
	in := m.in
	idx := in.stepNamed(m.def, r.Step) // the name its command carried (upgrade.go)
	switch {
	case idx < 0:
		return m.stale(fmt.Sprintf("reply for unknown step %q", r.Step))
	case in.State.Finished():
		return m.stale("reply after the saga " + string(in.State))
	case idx != in.Step:
		return m.stale(fmt.Sprintf("reply for step %q while the saga is at step %q", r.Step, m.def.step(in.Step).name))
	case r.Phase != in.phase():
		return m.stale(fmt.Sprintf("%s reply while the saga is %s", r.Phase, in.State))
	case r.Attempt > in.Attempt:
		return m.stale(fmt.Sprintf("reply for attempt %d, but only %d were sent", r.Attempt, in.Attempt))
	case r.Attempt < in.Attempt && r.Outcome != outbox.SagaOutcomeDone:
		// A late failure of an earlier attempt says nothing about the current one. A late
		// success does count: the effect happened, and the participant skips later attempts of
		// an action that took effect, so waiting for them would only time out.
		return m.stale(fmt.Sprintf("late %s reply of attempt %d (attempt %d is current)", r.Outcome, r.Attempt, in.Attempt))
	case in.Waiting == waitResend && r.Outcome != outbox.SagaOutcomeDone:
		return m.stale("failure reply while a re-send is already scheduled")
	}
	reason := r.Reason
	m.askedAfter = r.RetryAfter
	if len(reason) > maxReplyReason {
		reason = strings.ToValidUTF8(reason[:maxReplyReason], "") + "…"
	}
	rec := &in.Steps[idx]
	rec.Replies = append(rec.Replies, ReceivedReply{Phase: r.Phase, Attempt: r.Attempt, Outcome: r.Outcome, Reason: reason, EventID: r.EventID, At: m.now})
	return m.outcome(idx, r.Phase, r.Outcome, r.Reason, r.Payload, r.Attempt)
}

// outcome applies the outcome of an attempt of step idx's phase: a reply's or a local run's.
func (m *machine) outcome(idx int, phase outbox.SagaPhase, outcome, reason string, payload []byte, attempt int) error {
	rec := &m.in.Steps[idx]
	if outcome == outbox.SagaOutcomeRefused {
		rec.LastError = "refused: " + reason
		return m.stuck(fmt.Sprintf("step %q: the participant refused the %s: %s", rec.Name, phase, reason))
	}
	if phase == outbox.SagaPhaseAction {
		switch outcome {
		case outbox.SagaOutcomeDone:
			return m.actionDone(idx, Reply{Payload: payload, Attempt: attempt})
		case outbox.SagaOutcomeFailed:
			rec.LastError = "failed: " + reason
			if idx >= m.def.pivotIndex() {
				return m.resendLater(idx, rec.LastError) // past the point of no return: retry until it succeeds
			}
			return m.actionFailed(idx, rec.LastError, rec.Uncertain)
		case outbox.SagaOutcomeRetry:
			return m.retryOrGiveUp(idx, "retry: "+reason)
		}
		return m.stale(fmt.Sprintf("reply with unknown outcome %q", outcome)) // retrying cannot fix it
	}
	switch outcome {
	case outbox.SagaOutcomeDone:
		return m.compensationDone(idx)
	case outbox.SagaOutcomeFailed, outbox.SagaOutcomeRetry:
		return m.retryOrGiveUp(idx, outcome+": "+reason)
	}
	return m.stale(fmt.Sprintf("reply with unknown outcome %q", outcome))
}

func (m *machine) onTimer(t timer) error {
	in := m.in
	switch t.Kind {
	case timerDeadline:
		if in.State != StateRunning {
			return m.stale("deadline after the saga " + string(in.State))
		}
		if in.Step >= m.def.pivotIndex() {
			return m.stale("deadline after the pivot: the saga can only go forward")
		}
		return m.interrupt("saga deadline exceeded")
	case timerOperator:
		return m.onOperator(t.Action)
	case timerStep:
	default:
		return fmt.Errorf("saga: timer of unknown kind %q", t.Kind)
	}
	if in.State.Finished() || in.Step != t.Step || in.phase() != t.Phase || in.Attempt != t.Attempt {
		return m.stale("timer of a step or attempt that is over")
	}
	switch t.Action {
	case actRun:
		if in.Waiting != waitRun {
			return m.stale("run timer while not waiting to run a local step")
		}
		in.Waiting = waitReply
		return m.send(in.Step, in.phase(), in.Attempt)
	case actResend:
		if in.Waiting != waitResend {
			return m.stale("re-send timer while not waiting to re-send")
		}
		in.Attempt++
		in.Waiting = waitReply
		return m.send(in.Step, in.phase(), in.Attempt)
	case actTimeout:
		if in.Waiting != waitReply {
			return m.stale("timeout while not waiting for a reply")
		}
		rec := &in.Steps[in.Step]
		reason := fmt.Sprintf("attempt %d timed out after %s", in.Attempt, m.def.step(in.Step).timeout)
		if in.phase() == outbox.SagaPhaseAction {
			rec.Uncertain = true
			if in.Step >= m.def.pivotIndex() || in.Attempt-in.Budget < m.def.step(in.Step).attempts {
				rec.LastError = reason
				return m.resendNow(in.Step)
			}
			return m.actionFailed(in.Step, reason, true)
		}
		if in.Attempt-in.Budget < m.def.compensationAttempts() {
			rec.LastError = reason
			return m.resendNow(in.Step)
		}
		return m.stuck(reason)
	}
	return fmt.Errorf("saga: step timer with unknown action %q", t.Action)
}

func (m *machine) onOperator(action string) error {
	in := m.in
	switch action {
	case actRetry:
		if in.State != StateStuck {
			return m.stale("retry requested, but the saga is " + string(in.State) + ", not stuck")
		}
		// Resume the way it was going: a saga stuck while compensating (its compensation
		// kept failing) re-sends the compensation; one stuck moving forward (a reply that
		// could not be applied, a timer that failed) re-sends the step's command — the
		// participant answers a later attempt of an action that took effect with the result
		// it kept, so the saga moves on without running the action twice.
		phase := in.stuckPhase()
		if phase == outbox.SagaPhaseAction && m.pastDeadline() {
			// The deadline fell due while the saga was stuck, and its timer, finding the saga
			// stuck, was dropped: the saga compensates now, as the deadline would have made it
			// (its current step too, whose command may have acted).
			in.State, in.Error = StateRunning, ""
			return m.interrupt("saga deadline exceeded while it was stuck (retried after it)")
		}
		in.State = StateRunning
		if phase == outbox.SagaPhaseCompensation {
			in.State = StateCompensating
		}
		in.Error = ""
		in.Budget = in.Attempt // a fresh attempt budget
		in.Attempt++
		in.Waiting = waitReply
		return m.send(in.Step, phase, in.Attempt)
	case actCompensate:
		if in.State != StateRunning {
			return m.stale("compensation requested, but the saga is " + string(in.State))
		}
		if in.Step >= m.def.pivotIndex() {
			return m.stale("compensation requested after the pivot: the saga can only go forward")
		}
		return m.interrupt("compensation requested by an operator")
	}
	return fmt.Errorf("saga: operator request %q unknown", action)
}

// pastDeadline reports whether the saga-wide deadline (WithDeadline, counted from the saga's
// start on the database clock) has passed while the saga is before its pivot, where it still
// applies.
func (m *machine) pastDeadline() bool {
	d := m.def.deadline()
	return d > 0 && m.in.Step < m.def.pivotIndex() && !m.now.Before(m.in.CreatedAt.Add(d))
}

// interrupt fails the current step of a running saga from outside (its deadline, an
// operator). A remote step's command may still act, so its effect is unknown and it is
// compensated too; a local step between runs has no effect (its failed runs rolled back).
func (m *machine) interrupt(reason string) error {
	in := m.in
	if m.def.step(in.Step).local {
		return m.actionFailed(in.Step, reason, false)
	}
	in.Steps[in.Step].Uncertain = true // the command in flight may still act
	return m.actionFailed(in.Step, reason, true)
}

// actionDone: step idx took effect; run OnReply, then the next step or completion.
func (m *machine) actionDone(idx int, r Reply) error {
	in := m.in
	rec := &in.Steps[idx]
	rec.Status = stepDone
	rec.TookEffect = true
	rec.LastError = ""
	rec.FinishedAt = m.stamp()
	m.fx.cancelStep = true
	var data json.RawMessage
	var err error
	switch {
	case !m.def.step(idx).replyTx:
		data, err = m.def.onReply(idx, in.Data, r)
	case m.replyTx == nil:
		return fmt.Errorf("saga: step %q has an OnReplyTx handler, but the transition has no transaction", rec.Name)
	default:
		data, err = m.replyTx(idx, in.Data, r)
		var te transitionError
		if errors.As(err, &te) {
			return fmt.Errorf("step %q: reply handler: %w", rec.Name, te.err)
		}
	}
	if err != nil {
		// The effect happened but the orchestrator cannot use the reply: undo it with the rest.
		return m.compensateFrom(idx, fmt.Sprintf("step %q: reply handler: %v", rec.Name, err))
	}
	in.Data = data
	if idx+1 == len(in.Steps) {
		return m.finish(StateCompleted)
	}
	in.Step, in.Attempt, in.Budget, in.Waiting = idx+1, 1, 0, waitReply
	return m.send(idx+1, outbox.SagaPhaseAction, 1)
}

// actionFailed: step idx failed for good. Its own compensation runs only when its effect is
// unknown (a timeout, a deadline or an operator interrupted it): the participant's barrier
// makes that a no-op if the action never ran.
func (m *machine) actionFailed(idx int, reason string, includeCurrent bool) error {
	rec := &m.in.Steps[idx]
	rec.Status = stepFailed
	rec.LastError = reason
	rec.FinishedAt = m.stamp()
	m.fx.cancelStep = true
	from := idx - 1
	if includeCurrent {
		from = idx
	}
	return m.compensateFrom(from, fmt.Sprintf("step %q: %s", rec.Name, reason))
}

// compensateFrom starts compensating, from step from down to the first.
func (m *machine) compensateFrom(from int, reason string) error {
	m.in.Error = reason
	m.in.State = StateCompensating
	return m.nextCompensation(from)
}

// nextCompensation sends the compensation of the highest step <= from that took (or may have
// taken) effect and has one; steps without one are kept. None left: compensated.
func (m *machine) nextCompensation(from int) error {
	in := m.in
	for j := from; j >= 0; j-- {
		rec := &in.Steps[j]
		tookEffect := rec.Status == stepDone || (rec.Status == stepFailed && rec.Uncertain)
		if !tookEffect {
			continue
		}
		if !m.def.step(j).hasCompensation() {
			if rec.Status == stepDone {
				rec.Status = stepKept
			}
			continue
		}
		rec.Status = stepCompensating
		in.Step, in.Attempt, in.Budget, in.Waiting = j, 1, 0, waitReply
		return m.send(j, outbox.SagaPhaseCompensation, 1)
	}
	return m.finish(StateCompensated)
}

func (m *machine) compensationDone(idx int) error {
	rec := &m.in.Steps[idx]
	rec.Status = stepCompensated
	rec.LastError = ""
	rec.FinishedAt = m.stamp()
	m.fx.cancelStep = true
	return m.nextCompensation(idx - 1)
}

// retryOrGiveUp handles a failed attempt the participant asked to retry (or a failed
// compensation): re-send after the backoff while the budget lasts, else give up.
func (m *machine) retryOrGiveUp(idx int, reason string) error {
	in := m.in
	rec := &in.Steps[idx]
	rec.LastError = reason
	if in.phase() == outbox.SagaPhaseAction {
		if idx >= m.def.pivotIndex() || in.Attempt-in.Budget < m.def.step(idx).attempts {
			return m.resendLater(idx, reason)
		}
		return m.actionFailed(idx, fmt.Sprintf("%s (%s)", reason, in.afterAttempts()), rec.Uncertain)
	}
	if in.Attempt-in.Budget < m.def.compensationAttempts() {
		return m.resendLater(idx, reason)
	}
	return m.stuck(fmt.Sprintf("step %q: compensation %s (%s)", rec.Name, reason, in.afterAttempts()))
}

func (m *machine) resendLater(idx int, reason string) error {
	in := m.in
	in.Steps[idx].LastError = reason
	in.Waiting = waitResend
	backoff := m.def.step(idx).backoff
	if in.phase() == outbox.SagaPhaseCompensation {
		backoff = m.def.compensationBackoff()
	}
	wait := max(failure.Backoff(backoff, MaxBackoff, in.Attempt-in.Budget), min(m.askedAfter, engine.MaxRetryAfter))
	m.fx.setStep = &timer{Kind: timerStep, Step: idx, Phase: in.phase(), Attempt: in.Attempt, Action: actResend, Due: m.now.Add(wait)}
	return nil
}

func (m *machine) resendNow(idx int) error {
	m.in.Attempt++
	m.in.Waiting = waitReply
	return m.send(idx, m.in.phase(), m.in.Attempt)
}

func (m *machine) stuck(reason string) error {
	m.in.State = StateStuck
	m.in.Error = reason
	m.fx.cancelStep = true
	m.fx.becameStuck = true
	return nil
}

func (m *machine) finish(s State) error {
	m.in.State = s
	m.in.Waiting = ""
	m.fx.cancelAll = true
	m.fx.finished = s
	return nil
}

// send writes the command of step idx for phase and attempt, and sets (or clears) the step's
// reply timeout. A build function that fails cannot send: an action then fails the step, a
// compensation makes the saga stuck.
func (m *machine) send(idx int, phase outbox.SagaPhase, attempt int) error {
	in := m.in
	st := m.def.step(idx)
	rec := &in.Steps[idx]
	if st.isLocal(phase) {
		return m.runLocal(idx, phase, attempt)
	}
	topic, payload, err := m.def.command(idx, phase, in.Data)
	if err != nil {
		reason := fmt.Sprintf("build the %s command: %v", phase, err)
		if phase == outbox.SagaPhaseAction {
			return m.actionFailed(idx, reason, false)
		}
		return m.stuck(fmt.Sprintf("step %q: %s", rec.Name, reason))
	}
	msg := outbox.SetPartitionKey(outbox.NewMessage(payload), in.ID)
	outbox.SetSaga(msg, outbox.SagaRef{ID: in.ID, Step: rec.wireName(), Phase: phase, Attempt: attempt})
	msg.Metadata.Set(outbox.MetadataSagaName, in.Name)
	msg.Metadata.Set(outbox.MetadataSagaReplyTo, m.def.replyTopic())
	if rec.TookEffect {
		msg.Metadata.Set(outbox.MetadataSagaTookEffect, "true")
	}
	outbox.ToTopic(msg, topic)
	m.fx.commands = append(m.fx.commands, msg)
	if phase == outbox.SagaPhaseAction {
		rec.Status = stepRunning
		rec.Attempts++
	} else {
		rec.Status = stepCompensating
		rec.CompAttempts++
	}
	if rec.StartedAt == nil {
		rec.StartedAt = m.stamp()
	}
	rec.Sent = append(rec.Sent, SentCommand{Phase: phase, Attempt: attempt, Topic: topic, EventID: msg.UUID, At: m.now})
	in.wrote = msg.UUID
	if st.timeout > 0 {
		m.fx.setStep = &timer{Kind: timerStep, Step: idx, Phase: phase, Attempt: attempt, Action: actTimeout, Due: m.now.Add(st.timeout)}
	} else {
		m.fx.setStep, m.fx.cancelStep = nil, true
	}
	return nil
}

// runLocal asks the caller to run step idx's local phase now, in this transition (fx.local):
// no command, no reply timeout.
func (m *machine) runLocal(idx int, phase outbox.SagaPhase, attempt int) error {
	rec := &m.in.Steps[idx]
	if phase == outbox.SagaPhaseAction {
		rec.Status = stepRunning
		rec.Attempts++
	} else {
		rec.Status = stepCompensating
		rec.CompAttempts++
	}
	if rec.StartedAt == nil {
		rec.StartedAt = m.stamp()
	}
	m.fx.local = &localRun{Step: idx, Phase: phase, Attempt: attempt}
	m.fx.setStep, m.fx.cancelStep = nil, true
	return nil
}

func (m *machine) stamp() *time.Time {
	t := m.now
	return &t
}
