package saga

import "github.com/onceflow/onceflow/outbox"

// The participant's barrier (DTM's algorithm on processed_event), decided in one place.
//
// A participant records, per saga step, whether the step's action took effect (the action's
// barrier key) and whether its compensation did (the compensation's). A compensation first
// takes the action's key: if that key was free, the action never ran, and now never will —
// the compensation is recorded and answered without running its handler (null
// compensation), and an action arriving afterwards finds the compensation's key and is
// skipped (no hanging effect).

// barrierCmd is one new command of a batch as the barrier sees it.
type barrierCmd struct {
	Saga, Step string
	Phase      outbox.SagaPhase
	// Decided is set when an earlier run of the batch fixed the command's outcome (its
	// handler returned Fail or Retry, whose writes were rolled back): it is answered with
	// that outcome and takes no barrier key.
	Decided bool
	// TookEffect is set when the orchestrator knows the step's action took effect
	// (outbox.MetadataSagaTookEffect): a missing action record then means the record was
	// lost (deleted by hand, or by a cleaner that could not see the saga), not that the
	// action never ran.
	TookEffect bool
}

// stepID names one step of one saga.
type stepID struct{ saga, step string }

// barrierState is what the participant's records say of one step: whether its action and its
// compensation took effect.
type barrierState struct{ ActionTaken, CompTaken bool }

// barrierVerdict is what the barrier decides for one command.
type barrierVerdict int

const (
	// verdictRun: run the handler; its effect and the barrier key commit together.
	verdictRun barrierVerdict = iota
	// verdictDecided: answer with the outcome an earlier run of the batch fixed.
	verdictDecided
	// verdictTookEffect: an earlier attempt of the action took effect; answer with the
	// result it kept (the earlier reply may be the one the orchestrator gave up on, and a
	// retried saga waits for this answer).
	verdictTookEffect
	// verdictCompensated: an earlier attempt of the compensation took effect; answer done.
	verdictCompensated
	// verdictNullCompensation: the action never ran; record both keys and answer done
	// without running the compensation's handler.
	verdictNullCompensation
	// verdictHanging: the action arrived after its compensation; skip it, no reply.
	verdictHanging
	// verdictRefused: an action the orchestrator knows took effect has no record here: it is
	// not run again (that could apply it twice); the answer is SagaOutcomeRefused, and the
	// saga stops stuck for an operator.
	verdictRefused
)

// decideBarrier decides for each command, in batch order, given what the records said before
// the batch (before, by step; a missing step had neither key). Commands of the same step
// see the decisions before them: two attempts of one action run it once (the second is
// answered with what the first kept), an action and then its compensation run both, a
// compensation and then its action make a null compensation and a skipped hanging action.
// A run is assumed to succeed: when a handler fails, the batch is rolled back and decided
// again.
func decideBarrier(cmds []barrierCmd, before map[stepID]barrierState) []barrierVerdict {
	state := make(map[stepID]barrierState, len(before))
	out := make([]barrierVerdict, len(cmds))
	for i, c := range cmds {
		id := stepID{c.Saga, c.Step}
		s, seen := state[id]
		if !seen {
			s = before[id]
		}
		switch {
		case c.Decided:
			out[i] = verdictDecided
		case c.Phase == outbox.SagaPhaseAction && s.CompTaken:
			out[i] = verdictHanging
		case c.Phase == outbox.SagaPhaseAction && s.ActionTaken:
			out[i] = verdictTookEffect
		case c.Phase == outbox.SagaPhaseAction && c.TookEffect:
			out[i] = verdictRefused
		case c.Phase == outbox.SagaPhaseAction:
			out[i], s.ActionTaken = verdictRun, true
		case !s.ActionTaken && c.TookEffect:
			// The action's record is lost, but it took effect: undo it.
			out[i], s.ActionTaken, s.CompTaken = verdictRun, true, true
		case !s.ActionTaken:
			out[i], s.ActionTaken, s.CompTaken = verdictNullCompensation, true, true
		case s.CompTaken:
			out[i] = verdictCompensated
		default:
			out[i], s.CompTaken = verdictRun, true
		}
		state[id] = s
	}
	return out
}
