// Package relayprom exposes a relay's measurements as Prometheus metrics. It lives apart from
// package relay so that importing the relay does not pull in the Prometheus client.
//
//	m := relayprom.New(prometheus.DefaultRegisterer)
//	r, _ := relay.New(pool, sink, relay.Config{Metrics: m})
package relayprom

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/relay"
)

// Metrics implements relay.Metrics with Prometheus collectors, all prefixed onceflow_relay_.
type Metrics struct {
	published   prometheus.Counter
	publishTime prometheus.Histogram
	failed      *prometheus.CounterVec
	parked      prometheus.Counter
	owned       prometheus.Gauge
	pending     prometheus.Gauge
	oldest      prometheus.Gauge
}

var _ relay.Metrics = (*Metrics)(nil)

// New creates the collectors and registers them with reg (nil: not registered, e.g. to
// register them yourself through Collectors). It panics if they are already registered with
// reg, like prometheus.MustRegister.
func New(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		published: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "onceflow_relay_published_total",
			Help: "Messages the broker acknowledged (their outbox rows are then deleted).",
		}),
		publishTime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "onceflow_relay_publish_seconds",
			Help:    "Duration of one publish call to the broker (a batch, usually one round trip).",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
		}),
		failed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "onceflow_relay_errors_total",
			Help: "Failures by kind: permanent (broker refuses the message; counts toward parking), transient (retried with backoff), database (a relay query failed).",
		}, []string{"kind"}),
		parked: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "onceflow_relay_parked_total",
			Help: "Rows moved to outbox_parked after the retry limit.",
		}),
		owned: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "onceflow_relay_owned_shards",
			Help: "Shard leases this relay holds.",
		}),
		pending: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "onceflow_relay_pending_rows",
			Help: "Rows waiting in the outbox (all shards), sampled every stats interval.",
		}),
		oldest: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "onceflow_relay_oldest_pending_seconds",
			Help: "Age of the oldest row waiting in the outbox (0 when empty), sampled every stats interval.",
		}),
	}
	for _, kind := range []string{relay.FailPermanent, relay.FailTransient, relay.FailDatabase} {
		m.failed.WithLabelValues(kind) // export zeros so rate() works from the start
	}
	if reg != nil {
		reg.MustRegister(m.Collectors()...)
	}
	return m
}

// Collectors returns every collector, for registering them elsewhere.
func (m *Metrics) Collectors() []prometheus.Collector {
	return []prometheus.Collector{m.published, m.publishTime, m.failed, m.parked, m.owned, m.pending, m.oldest}
}

// Published implements relay.Metrics.
func (m *Metrics) Published(n int, took time.Duration) {
	m.published.Add(float64(n))
	m.publishTime.Observe(took.Seconds())
}

// Failed implements relay.Metrics.
func (m *Metrics) Failed(kind string, n int) { m.failed.WithLabelValues(kind).Add(float64(n)) }

// Parked implements relay.Metrics.
func (m *Metrics) Parked(n int) { m.parked.Add(float64(n)) }

// OwnedShards implements relay.Metrics.
func (m *Metrics) OwnedShards(n int) { m.owned.Set(float64(n)) }

// Pending implements relay.Metrics.
func (m *Metrics) Pending(rows int64, oldest time.Duration) {
	m.pending.Set(float64(rows))
	m.oldest.Set(oldest.Seconds())
}
