package sagaprom

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/pgsql"
)

// StatesCollector is a Prometheus collector of the sagas that have not finished, read from
// the saga table at every scrape:
//
//	onceflow_saga_active{saga, state}                  sagas running, compensating or stuck
//	onceflow_saga_oldest_active_seconds{saga, state}   age of the oldest of them
//
// Finished sagas (completed, compensated) are left out: retention keeps them by the million,
// and counting them would make every scrape a scan. The query uses saga_state_idx and is
// bounded by a timeout; a failed scrape reports an error for these two series.
type StatesCollector struct {
	pool    *pgxpool.Pool
	sql     string
	timeout time.Duration
	active  *prometheus.Desc
	oldest  *prometheus.Desc
}

// NewStatesCollector returns the collector of the saga table in schema ("" = "onceflow").
// Register it once per schema (reg.MustRegister(c)), in one process: every process would
// report the same figures.
func NewStatesCollector(pool *pgxpool.Pool, schema string) (*StatesCollector, error) {
	if schema == "" {
		schema = pgsql.DefaultSchema
	}
	if err := pgsql.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("sagaprom: %w", err)
	}
	if pool == nil {
		return nil, fmt.Errorf("sagaprom: pool is nil; pass the pool of the database holding the saga table")
	}
	return &StatesCollector{
		pool: pool,
		sql: `SELECT name, state, count(*), extract(epoch FROM now() - min(created_at))::float8 FROM ` + pgsql.Table(schema, "saga") + `
			WHERE state NOT IN ('completed', 'compensated') GROUP BY name, state`,
		timeout: 5 * time.Second,
		active: prometheus.NewDesc("onceflow_saga_active", "Sagas not finished, by definition and state (running, compensating, stuck), read from the saga table at scrape time.",
			[]string{"saga", "state"}, nil),
		oldest: prometheus.NewDesc("onceflow_saga_oldest_active_seconds", "Age of the oldest saga not finished, by definition and state.",
			[]string{"saga", "state"}, nil),
	}, nil
}

var _ prometheus.Collector = (*StatesCollector)(nil)

// Describe implements prometheus.Collector.
func (c *StatesCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.active
	ch <- c.oldest
}

// Collect implements prometheus.Collector.
func (c *StatesCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	rows, err := c.pool.Query(ctx, c.sql)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.active, fmt.Errorf("sagaprom: count sagas by state: %w", err))
		return
	}
	defer rows.Close()
	for rows.Next() {
		var name, state string
		var n int64
		var age float64
		if err := rows.Scan(&name, &state, &n, &age); err != nil {
			ch <- prometheus.NewInvalidMetric(c.active, err)
			return
		}
		ch <- prometheus.MustNewConstMetric(c.active, prometheus.GaugeValue, float64(n), name, state)
		ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, age, name, state)
	}
	if err := rows.Err(); err != nil {
		ch <- prometheus.NewInvalidMetric(c.active, err)
	}
}
