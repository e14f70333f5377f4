package inboxprom

import (
	"context"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/inbox"
)

// LaneCollector reports the retry lane (inbox.RetryAfter) per consumer, read from the
// schema's inbox_parked table at scrape time with inbox.Admin.ParkedSummary (a few index
// ranges, 2–16 ms at 100,000 parked rows):
//
//	onceflow_inbox_parked_messages{consumer}        messages parked, heads and those behind them (counted up to 10,001)
//	onceflow_inbox_parked_keys{consumer}            keys holding parked messages (counted up to 10,001)
//	onceflow_inbox_parked_oldest_seconds{consumer}  how long the key that waited longest has waited
//	onceflow_inbox_parked_lag_seconds{consumer}     how long the earliest due head is past its due time (0 when none is due)
//
// A consumer with nothing parked has no series. The lag stays near Config.LaneInterval while
// a process of the consumer applies due heads; when it grows, none does (the same figures as
// `onceflow status`'s --max-lane-wait and --max-lane-lag, and docs/alerts.yml's rules).
type LaneCollector struct {
	db      inbox.DB
	admin   *inbox.Admin
	timeout time.Duration
	rows    *prometheus.Desc
	keys    *prometheus.Desc
	oldest  *prometheus.Desc
	lag     *prometheus.Desc
}

var _ prometheus.Collector = (*LaneCollector)(nil)

// NewLaneCollector returns the collector of the retry lane in schema ("" = "onceflow"); db is
// usually a *pgxpool.Pool. Register it once per schema (reg.MustRegister(c)), in one process:
// every process would report the same figures.
func NewLaneCollector(db inbox.DB, schema string) (*LaneCollector, error) {
	if db == nil {
		return nil, fmt.Errorf("inboxprom: db is nil; pass the pool of the database holding the inbox tables")
	}
	admin, err := inbox.NewAdmin(schema)
	if err != nil {
		return nil, err
	}
	desc := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc("onceflow_inbox_parked_"+name, help, []string{"consumer"}, nil)
	}
	return &LaneCollector{
		db: db, admin: admin, timeout: 5 * time.Second,
		rows:   desc("messages", "Messages parked in the consumer's retry lane (inbox.RetryAfter), heads and those behind them; counted up to 10,001."),
		keys:   desc("keys", "Keys holding parked messages in the consumer's retry lane; counted up to 10,001."),
		oldest: desc("oldest_seconds", "How long the key that waited longest in the consumer's retry lane has waited."),
		lag:    desc("lag_seconds", "How long the earliest due head of the consumer's retry lane is past its due time; grows when no process of the consumer applies due heads."),
	}, nil
}

// Describe implements prometheus.Collector.
func (c *LaneCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.rows, c.keys, c.oldest, c.lag} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *LaneCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	sum, err := c.admin.ParkedSummary(ctx, c.db)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.rows, fmt.Errorf("inboxprom: read the retry lane: %w", err))
		return
	}
	for _, p := range sum {
		ch <- prometheus.MustNewConstMetric(c.rows, prometheus.GaugeValue, float64(p.Rows), p.Consumer)
		ch <- prometheus.MustNewConstMetric(c.keys, prometheus.GaugeValue, float64(p.Keys), p.Consumer)
		ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, p.OldestAge().Seconds(), p.Consumer)
		ch <- prometheus.MustNewConstMetric(c.lag, prometheus.GaugeValue, p.Lag().Seconds(), p.Consumer)
	}
}
