// Package relayprom reports a relay's measurements to Prometheus. It lives apart from package
// relay so that importing the relay does not pull in the Prometheus client.
//
//	m, err := relayprom.New(prometheus.DefaultRegisterer)
//	r, err := relay.New(relay.Config{Pool: pool, Sink: sink, Metrics: m})
package relayprom

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/relay"
)

// Metrics implements relay.Metrics with these Prometheus collectors:
//
//	onceflow_relay_published_total              messages the broker acknowledged
//	onceflow_relay_publish_seconds              duration of one sink call (a batch)
//	onceflow_relay_errors_total{kind}           kind: undeliverable, transient, database
//	onceflow_relay_parked_total                 rows moved to outbox_parked
//	onceflow_relay_owned_shards                 shard leases this relay holds
//	onceflow_relay_pending_rows                 rows waiting in the outbox (sampled; estimate above 10k)
//	onceflow_relay_oldest_pending_seconds       age of the oldest waiting row (sampled)
//	onceflow_relay_parked_rows                  rows in outbox_parked (sampled)
//	onceflow_relay_scheduled_rows               scheduled messages waiting for their due time (sampled; estimate above 10k)
//	onceflow_relay_scheduled_overdue_rows       scheduled messages due over 5 s ago and not moved (sampled; up to 10k)
//	onceflow_relay_lease_renewals_total{result} lease rounds; result: ok, failed
//
// docs/operations.md lists them with their units and the alerts built on them.
type Metrics struct {
	published   prometheus.Counter
	publishTime prometheus.Histogram
	failed      *prometheus.CounterVec
	parked      prometheus.Counter
	owned       prometheus.Gauge
	pending     prometheus.Gauge
	oldest      prometheus.Gauge
	parkedRows  prometheus.Gauge
	scheduled   prometheus.Gauge
	overdue     prometheus.Gauge
	renewals    *prometheus.CounterVec
}

var _ relay.Metrics = (*Metrics)(nil)

// New registers the collectors on reg (prometheus.DefaultRegisterer when nil) and returns the
// Metrics to put in relay.Config.Metrics. It returns the registration error, e.g. when reg
// already holds them: one Metrics serves one relay per registry.
func New(reg prometheus.Registerer) (*Metrics, error) {
	if reg == nil {
		reg = prometheus.DefaultRegisterer
	}
	m := &Metrics{
		published: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "onceflow", Subsystem: "relay", Name: "published_total",
			Help: "Messages the broker acknowledged (their outbox rows are then deleted).",
		}),
		publishTime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "onceflow", Subsystem: "relay", Name: "publish_seconds",
			Help:    "Duration of one publish call to the broker (a batch, usually one round trip).",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
		}),
		failed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "onceflow", Subsystem: "relay", Name: "errors_total",
			Help: "Failures by kind: undeliverable (the broker refuses the message; counts toward parking), transient (retried with backoff), database (a relay query failed).",
		}, []string{"kind"}),
		parked: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "onceflow", Subsystem: "relay", Name: "parked_total",
			Help: "Rows moved to outbox_parked after the retry limit.",
		}),
		owned: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "onceflow", Subsystem: "relay", Name: "owned_shards",
			Help: "Shard leases this relay holds.",
		}),
		pending: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "onceflow", Subsystem: "relay", Name: "pending_rows",
			Help: "Rows waiting in the outbox (all shards), sampled every stats interval: exact up to 10000, above that an estimate (the table's live-tuple statistic, bounded by the id span).",
		}),
		oldest: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "onceflow", Subsystem: "relay", Name: "oldest_pending_seconds",
			Help: "Age of the oldest row waiting in the outbox (0 when empty), sampled every stats interval.",
		}),
		parkedRows: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "onceflow", Subsystem: "relay", Name: "parked_rows",
			Help: "Rows in outbox_parked waiting for an operator (onceflow outbox parked / replay), sampled every stats interval, counted up to 10000.",
		}),
		scheduled: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "onceflow", Subsystem: "relay", Name: "scheduled_rows",
			Help: "Scheduled messages (outbox.DeliverAt) waiting in outbox_scheduled for their due time, sampled every stats interval: exact up to 10000, above that an estimate (the table's live-tuple statistic). Not part of pending_rows until due.",
		}),
		overdue: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "onceflow", Subsystem: "relay", Name: "scheduled_overdue_rows",
			Help: "Scheduled messages due more than 5 s ago and still not moved into the outbox, sampled every stats interval, counted up to 10000: above 0 for long, no relay moves scheduled messages.",
		}),
		renewals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "onceflow", Subsystem: "relay", Name: "lease_renewals_total",
			Help: "Lease rounds (renew, acquire, rebalance) by result: ok or failed. Failures past the lease duration stop publishing.",
		}, []string{"result"}),
	}
	for _, kind := range []relay.FailureKind{relay.FailureUndeliverable, relay.FailureTransient, relay.FailureDatabase} {
		m.failed.WithLabelValues(string(kind)) // export zeros so rate() works from the start
	}
	m.renewals.WithLabelValues("ok")
	m.renewals.WithLabelValues("failed")
	for _, c := range []prometheus.Collector{m.published, m.publishTime, m.failed, m.parked, m.owned, m.pending, m.oldest, m.parkedRows, m.scheduled, m.overdue, m.renewals} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Published implements relay.Metrics.
func (m *Metrics) Published(n int, took time.Duration) {
	m.published.Add(float64(n))
	m.publishTime.Observe(took.Seconds())
}

// Failed implements relay.Metrics.
func (m *Metrics) Failed(kind relay.FailureKind, n int) {
	m.failed.WithLabelValues(string(kind)).Add(float64(n))
}

// Parked implements relay.Metrics.
func (m *Metrics) Parked(n int) { m.parked.Add(float64(n)) }

// OwnedShards implements relay.Metrics.
func (m *Metrics) OwnedShards(n int) { m.owned.Set(float64(n)) }

// Pending implements relay.Metrics.
func (m *Metrics) Pending(rows int64, oldest time.Duration) {
	m.pending.Set(float64(rows))
	m.oldest.Set(oldest.Seconds())
}

// ParkedRows implements relay.Metrics.
func (m *Metrics) ParkedRows(n int64) { m.parkedRows.Set(float64(n)) }

// ScheduledRows implements relay.Metrics.
func (m *Metrics) ScheduledRows(rows, overdue int64) {
	m.scheduled.Set(float64(rows))
	m.overdue.Set(float64(overdue))
}

// LeaseRenewal implements relay.Metrics.
func (m *Metrics) LeaseRenewal(ok bool) {
	result := "ok"
	if !ok {
		result = "failed"
	}
	m.renewals.WithLabelValues(result).Inc()
}
