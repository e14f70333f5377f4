// Package inboxprom reports inbox and redisdedup metrics to Prometheus. It lives apart from
// package inbox so that using the inbox does not pull in the Prometheus client.
package inboxprom

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/inbox"
)

// Metrics implements inbox.Metrics with two Prometheus collectors:
//
//	onceflow_inbox_messages_total{consumer, result}   result: processed, duplicate, failed, no_key, poisoned, parked
//	onceflow_inbox_processing_seconds{consumer}       transaction time of processed messages
type Metrics struct {
	messages *prometheus.CounterVec
	took     *prometheus.HistogramVec
}

var _ inbox.Metrics = (*Metrics)(nil)

// New registers the collectors on reg (prometheus.DefaultRegisterer when nil) and returns the
// Metrics to put in inbox.Config.Metrics or redisdedup.Config.Metrics. Several inboxes can
// share one Metrics; the consumer label tells them apart.
func New(reg prometheus.Registerer) (*Metrics, error) {
	if reg == nil {
		reg = prometheus.DefaultRegisterer
	}
	m := &Metrics{
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "onceflow", Subsystem: "inbox", Name: "messages_total",
			Help: "Messages seen by the inbox middleware, by consumer and result (processed, duplicate, failed, no_key, poisoned, parked).",
		}, []string{"consumer", "result"}),
		took: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "onceflow", Subsystem: "inbox", Name: "processing_seconds",
			Help:    "Time from the start of a message's inbox transaction to the end of its commit.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 14), // 1ms .. ~8s
		}, []string{"consumer"}),
	}
	for _, c := range []prometheus.Collector{m.messages, m.took} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Processed implements inbox.Metrics.
func (m *Metrics) Processed(consumer string, took time.Duration) {
	m.messages.WithLabelValues(consumer, "processed").Inc()
	m.took.WithLabelValues(consumer).Observe(took.Seconds())
}

// Duplicate implements inbox.Metrics.
func (m *Metrics) Duplicate(consumer string) { m.messages.WithLabelValues(consumer, "duplicate").Inc() }

// Failed implements inbox.Metrics.
func (m *Metrics) Failed(consumer string) { m.messages.WithLabelValues(consumer, "failed").Inc() }

// NoKey implements inbox.Metrics.
func (m *Metrics) NoKey(consumer string) { m.messages.WithLabelValues(consumer, "no_key").Inc() }

// Poisoned implements inbox.Metrics.
func (m *Metrics) Poisoned(consumer string) { m.messages.WithLabelValues(consumer, "poisoned").Inc() }

// Parked implements inbox.Metrics: the outcome "parked" (the retry lane).
func (m *Metrics) Parked(consumer string) { m.messages.WithLabelValues(consumer, "parked").Inc() }
