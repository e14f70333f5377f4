// Package sagaprom reports saga metrics to Prometheus. It lives apart from package saga so
// that using sagas does not pull in the Prometheus client.
//
//	m, err := sagaprom.New(prometheus.DefaultRegisterer)
//	orch, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: pool, Metrics: m})
//	part, err := saga.NewParticipant(saga.ParticipantConfig{Pool: pool, Consumer: "inventory", Metrics: m})
package sagaprom

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

// Metrics implements saga.Metrics with these Prometheus collectors:
//
//	onceflow_saga_started_total{saga}           sagas started (StartTx with WithMetrics)
//	onceflow_saga_finished_total{saga, state}   state: completed, compensated
//	onceflow_saga_duration_seconds{saga, state} start to end of finished sagas
//	onceflow_saga_stuck_total{saga}             sagas whose compensation ran out of attempts
//	onceflow_saga_ignored_total{saga}           late, duplicate-attempt or unknown replies and timers
//	onceflow_saga_barrier_total{consumer, outcome}  outcome: duplicate, null_compensation, hanging_action
//	onceflow_saga_step_errors_total{consumer}   commands whose handler kept failing, answered as failed attempts
//	onceflow_saga_local_steps_total{saga, step, phase, outcome}  local step runs; outcome: done, failed, retry
//	onceflow_saga_awaiting_version_total{saga, version}  replies parked for an orchestrator that has their saga's version
type Metrics struct {
	saga.NopMetrics
	started  *prometheus.CounterVec
	finished *prometheus.CounterVec
	duration *prometheus.HistogramVec
	stuck    *prometheus.CounterVec
	ignored  *prometheus.CounterVec
	barrier  *prometheus.CounterVec
	errors   *prometheus.CounterVec
	local    *prometheus.CounterVec
	awaiting *prometheus.CounterVec
}

var _ saga.Metrics = (*Metrics)(nil)

// New registers the collectors on reg (prometheus.DefaultRegisterer when nil) and returns the
// Metrics to put in the orchestrator's, the participants' and StartTx's configuration. It
// returns the registration error, e.g. when reg already holds them.
func New(reg prometheus.Registerer) (*Metrics, error) {
	if reg == nil {
		reg = prometheus.DefaultRegisterer
	}
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "onceflow", Subsystem: "saga", Name: name, Help: help}, labels)
	}
	m := &Metrics{
		started:  counter("started_total", "Sagas started.", "saga"),
		finished: counter("finished_total", "Sagas that ended, by final state (completed, compensated).", "saga", "state"),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "onceflow", Subsystem: "saga", Name: "duration_seconds",
			Help:    "Time from a saga's start to its end, by final state.",
			Buckets: prometheus.ExponentialBuckets(0.005, 2, 16), // 5ms .. ~160s
		}, []string{"saga", "state"}),
		stuck:   counter("stuck_total", "Sagas whose compensation ran out of attempts; they wait for `onceflow saga retry`.", "saga"),
		ignored: counter("ignored_total", "Replies, timers and operator requests that changed nothing (late, for a finished saga, ...).", "saga"),
		barrier: counter("barrier_total", "Commands a participant's barrier skipped or short-cut, by outcome (duplicate, null_compensation, hanging_action).", "consumer", "outcome"),
		errors:  counter("step_errors_total", "Commands whose handler kept failing with an ordinary error, answered as failed attempts carrying it.", "consumer"),
		local:   counter("local_steps_total", "Local step runs (in the orchestrator's transaction) that committed, by outcome (done, failed, retry).", "saga", "step", "phase", "outcome"),
		awaiting: counter("awaiting_version_total", "Replies that reached an orchestrator without their saga's definition version registered, "+
			"parked until one that has it applies them (a rolling deploy); growing means no running orchestrator has that version.", "saga", "version"),
	}
	for _, c := range []prometheus.Collector{m.started, m.finished, m.duration, m.stuck, m.ignored, m.barrier, m.errors, m.local, m.awaiting} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Started implements saga.Metrics.
func (m *Metrics) Started(name string) { m.started.WithLabelValues(name).Inc() }

// Completed implements saga.Metrics.
func (m *Metrics) Completed(name string, took time.Duration) { m.finish(name, "completed", took) }

// Compensated implements saga.Metrics.
func (m *Metrics) Compensated(name string, took time.Duration) { m.finish(name, "compensated", took) }

func (m *Metrics) finish(name, state string, took time.Duration) {
	m.finished.WithLabelValues(name, state).Inc()
	m.duration.WithLabelValues(name, state).Observe(took.Seconds())
}

// Stuck implements saga.Metrics.
func (m *Metrics) Stuck(name string) { m.stuck.WithLabelValues(name).Inc() }

// Ignored implements saga.Metrics.
func (m *Metrics) Ignored(name string) { m.ignored.WithLabelValues(name).Inc() }

// Barrier implements saga.Metrics.
func (m *Metrics) Barrier(consumer string, o saga.BarrierOutcome) {
	m.barrier.WithLabelValues(consumer, string(o)).Inc()
}

// StepError implements saga.Metrics.
func (m *Metrics) StepError(consumer string) { m.errors.WithLabelValues(consumer).Inc() }

// AwaitingVersion implements saga.Metrics.
func (m *Metrics) AwaitingVersion(name string, version int) {
	m.awaiting.WithLabelValues(name, strconv.Itoa(version)).Inc()
}

// LocalStep implements saga.Metrics.
func (m *Metrics) LocalStep(name, step string, phase outbox.SagaPhase, outcome string) {
	m.local.WithLabelValues(name, step, string(phase), outcome).Inc()
}
