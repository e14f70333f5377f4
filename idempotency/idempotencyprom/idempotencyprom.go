// Package idempotencyprom reports the HTTP idempotency middleware's outcomes to Prometheus.
// It lives apart from package idempotency so that using the middleware does not pull in the
// Prometheus client.
//
//	m, err := idempotencyprom.New(prometheus.DefaultRegisterer)
//	mw, err := idempotency.New(idempotency.Config{Pool: pool, Metrics: m})
package idempotencyprom

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/idempotency"
)

// Metrics implements idempotency.Metrics with two collectors:
//
//	onceflow_idempotency_requests_total{outcome}    keyed requests by outcome
//	onceflow_idempotency_request_seconds{outcome}   time in the middleware, handler included
//
// outcome is an idempotency.Outcome: stored, not_stored, replayed, mismatch, in_flight,
// not_replayed, rejected, storage_error, canceled, panic, tx_misuse.
type Metrics struct {
	requests *prometheus.CounterVec
	took     *prometheus.HistogramVec
}

var _ idempotency.Metrics = (*Metrics)(nil)

// New registers the collectors on reg (prometheus.DefaultRegisterer when nil) and returns the
// Metrics to put in idempotency.Config.Metrics. It returns the registration error, e.g. when
// reg already holds them; several middlewares can share one Metrics.
func New(reg prometheus.Registerer) (*Metrics, error) {
	if reg == nil {
		reg = prometheus.DefaultRegisterer
	}
	m := &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "onceflow", Subsystem: "idempotency", Name: "requests_total",
			Help: "Requests with an Idempotency-Key by outcome (stored, replayed, in_flight, mismatch, not_stored, not_replayed, rejected, storage_error, canceled, panic, tx_misuse).",
		}, []string{"outcome"}),
		took: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "onceflow", Subsystem: "idempotency", Name: "request_seconds",
			Help:    "Time a keyed request spent in the idempotency middleware, the handler and the commit included, by outcome.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 14), // 1ms .. ~8s
		}, []string{"outcome"}),
	}
	for _, o := range []idempotency.Outcome{idempotency.OutcomeStored, idempotency.OutcomeReplayed, idempotency.OutcomeMismatch,
		idempotency.OutcomeInFlight, idempotency.OutcomeStorageFail} {
		m.requests.WithLabelValues(string(o)) // export zeros so rate() and alerts work from the start
	}
	for _, c := range []prometheus.Collector{m.requests, m.took} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Observe implements idempotency.Metrics.
func (m *Metrics) Observe(o idempotency.Outcome, elapsed time.Duration) {
	m.requests.WithLabelValues(string(o)).Inc()
	m.took.WithLabelValues(string(o)).Observe(elapsed.Seconds())
}
