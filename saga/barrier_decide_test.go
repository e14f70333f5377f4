package saga

import (
	"slices"
	"testing"

	"github.com/onceflow/onceflow/outbox"
)

// TestDecideBarrier is the barrier's decision table: commands of one batch, decided per
// (saga, step) in batch order, from what the participant's records held before the batch.
func TestDecideBarrier(t *testing.T) {
	const (
		act  = outbox.SagaPhaseAction
		comp = outbox.SagaPhaseCompensation
	)
	a := func(saga string) barrierCmd { return barrierCmd{Saga: saga, Step: "reserve", Phase: act} }
	c := func(saga string) barrierCmd { return barrierCmd{Saga: saga, Step: "reserve", Phase: comp} }
	decided := func(b barrierCmd) barrierCmd { b.Decided = true; return b }
	tookEffect := func(b barrierCmd) barrierCmd { b.TookEffect = true; return b }
	s1 := stepID{"s1", "reserve"}
	none := map[stepID]barrierState{}
	actionTook := map[stepID]barrierState{s1: {ActionTaken: true}}
	compensated := map[stepID]barrierState{s1: {ActionTaken: true, CompTaken: true}}

	for _, tc := range []struct {
		name   string
		cmds   []barrierCmd
		before map[stepID]barrierState
		want   []barrierVerdict
	}{
		{"a new action runs", []barrierCmd{a("s1")}, none, []barrierVerdict{verdictRun}},
		{"two attempts of one action in one batch: it runs once, the second is answered with its result",
			[]barrierCmd{a("s1"), a("s1")}, none, []barrierVerdict{verdictRun, verdictTookEffect}},
		{"three attempts, the first decided (Fail/Retry rolled back): the second runs",
			[]barrierCmd{decided(a("s1")), a("s1"), a("s1")}, none, []barrierVerdict{verdictDecided, verdictRun, verdictTookEffect}},
		{"a later attempt of an action that took effect earlier is answered, not run",
			[]barrierCmd{a("s1")}, actionTook, []barrierVerdict{verdictTookEffect}},
		{"an action after its compensation hangs", []barrierCmd{a("s1")}, compensated, []barrierVerdict{verdictHanging}},
		{"a compensation of an action that never ran is null", []barrierCmd{c("s1")}, none, []barrierVerdict{verdictNullCompensation}},
		{"a compensation of an action that ran runs", []barrierCmd{c("s1")}, actionTook, []barrierVerdict{verdictRun}},
		{"two attempts of one compensation in one batch: it runs once, the second is answered done",
			[]barrierCmd{c("s1"), c("s1")}, actionTook, []barrierVerdict{verdictRun, verdictCompensated}},
		{"two attempts of a null compensation: null once, then answered done",
			[]barrierCmd{c("s1"), c("s1")}, none, []barrierVerdict{verdictNullCompensation, verdictCompensated}},
		{"a later attempt of a compensation that took effect is answered done",
			[]barrierCmd{c("s1")}, compensated, []barrierVerdict{verdictCompensated}},
		{"action then its compensation in one batch: both run",
			[]barrierCmd{a("s1"), c("s1")}, none, []barrierVerdict{verdictRun, verdictRun}},
		{"compensation then its action in one batch: null compensation, hanging action",
			[]barrierCmd{c("s1"), a("s1")}, none, []barrierVerdict{verdictNullCompensation, verdictHanging}},
		{"a decided compensation takes no key: the next attempt is decided afresh",
			[]barrierCmd{decided(c("s1")), c("s1")}, actionTook, []barrierVerdict{verdictDecided, verdictRun}},
		{"other sagas are independent",
			[]barrierCmd{a("s1"), a("s2"), a("s1"), c("s3")}, actionTook,
			[]barrierVerdict{verdictTookEffect, verdictRun, verdictTookEffect, verdictNullCompensation}},
		{"an action the orchestrator knows took effect, without its record here, is refused",
			[]barrierCmd{tookEffect(a("s1"))}, none, []barrierVerdict{verdictRefused}},
		{"an action the orchestrator knows took effect, with its record, is answered",
			[]barrierCmd{tookEffect(a("s1"))}, actionTook, []barrierVerdict{verdictTookEffect}},
		{"a compensation of an action known to have taken effect runs, even without its record",
			[]barrierCmd{tookEffect(c("s1"))}, none, []barrierVerdict{verdictRun}},
		{"its second attempt in the batch is answered done",
			[]barrierCmd{tookEffect(c("s1")), tookEffect(c("s1"))}, none, []barrierVerdict{verdictRun, verdictCompensated}},
		{"steps of one saga are independent",
			[]barrierCmd{a("s1"), {Saga: "s1", Step: "charge", Phase: act}}, actionTook,
			[]barrierVerdict{verdictTookEffect, verdictRun}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := decideBarrier(tc.cmds, tc.before)
			if !slices.Equal(got, tc.want) {
				t.Fatalf("decideBarrier = %v, want %v", got, tc.want)
			}
		})
	}
}
