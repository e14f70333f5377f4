package saga

import (
	"sync/atomic"
	"time"

	"github.com/onceflow/onceflow/outbox"
)

// Metrics receives the saga package's measurements: the orchestrator's transitions and the
// participants' barrier decisions. It is a small interface so the package does not force a
// metrics library on its users; saga/sagaprom adapts it to Prometheus and Counters keeps
// plain totals. Implementations must be safe for concurrent use and must not block. Embed
// NopMetrics so that methods added later do not break an implementation.
type Metrics interface {
	// Started: StartTx created a saga (counted when WithMetrics is given).
	Started(name string)
	// Completed: the saga's last step succeeded; took is the time since its start.
	Completed(name string, took time.Duration)
	// Compensated: the saga ended after compensating; took is the time since its start.
	Compensated(name string, took time.Duration)
	// Stuck: a compensation ran out of attempts; the saga waits for an operator.
	Stuck(name string)
	// Ignored: a reply, timer or operator request that changed nothing (late, duplicate
	// attempt, for a finished saga, ...), acknowledged rather than treated as an error.
	Ignored(name string)
	// Barrier: a participant skipped or short-cut a command: outcome is BarrierDuplicate (the
	// same delivery again), BarrierNullCompensation (a compensation whose action never ran)
	// or BarrierHangingAction (an action arriving after its compensation).
	Barrier(consumer string, outcome BarrierOutcome)
	// LocalStep: a local step's action or compensation ran in a committed transition;
	// outcome is done, failed (saga.Fail) or retry (any other error: it runs again later).
	LocalStep(name, step string, phase outbox.SagaPhase, outcome string)
	// StepError: a participant's handler kept failing with an ordinary error (neither Fail
	// nor Retry) and its command was answered as a failed attempt carrying the error.
	StepError(consumer string)
	// AwaitingVersion: a reply reached an orchestrator that does not have its saga's
	// definition version registered, and was parked until one that has it applies it (a
	// rolling deploy: docs/sagas.md, "Rolling deploys: versions side by side"). A count that
	// keeps growing means no running orchestrator has that version.
	AwaitingVersion(name string, version int)
}

// BarrierOutcome names what a participant's barrier did with a command.
type BarrierOutcome string

// The barrier outcomes.
const (
	BarrierDuplicate        BarrierOutcome = "duplicate"
	BarrierNullCompensation BarrierOutcome = "null_compensation"
	BarrierHangingAction    BarrierOutcome = "hanging_action"
	// BarrierRefused: an action the orchestrator knows took effect had no record here, so it
	// was not run again (the saga stops stuck for an operator).
	BarrierRefused BarrierOutcome = "refused"
)

// NopMetrics discards every measurement. Embed it in your own Metrics implementation.
type NopMetrics struct{}

var _ Metrics = NopMetrics{}

// Started implements Metrics.
func (NopMetrics) Started(string) {}

// Completed implements Metrics.
func (NopMetrics) Completed(string, time.Duration) {}

// Compensated implements Metrics.
func (NopMetrics) Compensated(string, time.Duration) {}

// Stuck implements Metrics.
func (NopMetrics) Stuck(string) {}

// Ignored implements Metrics.
func (NopMetrics) Ignored(string) {}

// StepError implements Metrics.
func (NopMetrics) StepError(string) {}

// LocalStep implements Metrics.
func (NopMetrics) LocalStep(string, string, outbox.SagaPhase, string) {}

// Barrier implements Metrics.
func (NopMetrics) Barrier(string, BarrierOutcome) {}

// AwaitingVersion implements Metrics.
func (NopMetrics) AwaitingVersion(string, int) {}

// Counters is a Metrics that keeps totals over all sagas and participants, for tests, demos
// and health pages. The zero value is ready to use.
type Counters struct {
	started, completed, compensated, stuck, ignored atomic.Int64
	duplicates, nullCompensations, hangingActions   atomic.Int64
	stepErrors                                      atomic.Int64
	localRuns, localFailures                        atomic.Int64
	awaitingVersion                                 atomic.Int64
}

var _ Metrics = (*Counters)(nil)

// Started implements Metrics.
func (c *Counters) Started(string) { c.started.Add(1) }

// Completed implements Metrics.
func (c *Counters) Completed(string, time.Duration) { c.completed.Add(1) }

// Compensated implements Metrics.
func (c *Counters) Compensated(string, time.Duration) { c.compensated.Add(1) }

// Stuck implements Metrics.
func (c *Counters) Stuck(string) { c.stuck.Add(1) }

// Ignored implements Metrics.
func (c *Counters) Ignored(string) { c.ignored.Add(1) }

// StepError implements Metrics.
func (c *Counters) StepError(string) { c.stepErrors.Add(1) }

// AwaitingVersion implements Metrics.
func (c *Counters) AwaitingVersion(string, int) { c.awaitingVersion.Add(1) }

// LocalStep implements Metrics.
func (c *Counters) LocalStep(_, _ string, _ outbox.SagaPhase, outcome string) {
	c.localRuns.Add(1)
	if outcome != outbox.SagaOutcomeDone {
		c.localFailures.Add(1)
	}
}

// Barrier implements Metrics.
func (c *Counters) Barrier(_ string, o BarrierOutcome) {
	switch o {
	case BarrierDuplicate:
		c.duplicates.Add(1)
	case BarrierNullCompensation:
		c.nullCompensations.Add(1)
	case BarrierHangingAction:
		c.hangingActions.Add(1)
	}
}

// CountersSnapshot is a point-in-time copy of Counters.
type CountersSnapshot struct {
	Started, Completed, Compensated, Stuck, Ignored int64
	Duplicates, NullCompensations, HangingActions   int64
	StepErrors                                      int64
	// LocalRuns counts local step runs (actions and compensations) that committed;
	// LocalFailures those of them that failed (saga.Fail or an error).
	LocalRuns, LocalFailures int64
	// AwaitingVersion counts replies parked because the orchestrator lacked their saga's
	// definition version.
	AwaitingVersion int64
}

// Snapshot returns the current totals.
func (c *Counters) Snapshot() CountersSnapshot {
	return CountersSnapshot{
		Started: c.started.Load(), Completed: c.completed.Load(), Compensated: c.compensated.Load(),
		Stuck: c.stuck.Load(), Ignored: c.ignored.Load(),
		Duplicates: c.duplicates.Load(), NullCompensations: c.nullCompensations.Load(), HangingActions: c.hangingActions.Load(),
		LocalRuns: c.localRuns.Load(), LocalFailures: c.localFailures.Load(),
		StepErrors: c.stepErrors.Load(), AwaitingVersion: c.awaitingVersion.Load(),
	}
}
