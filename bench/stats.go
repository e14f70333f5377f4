package main

import (
	"context"
	"fmt"
	"time"

	"github.com/onceflow/onceflow/relay"
)

// benchStats: the cost of the relay's backlog sample (every StatsInterval, in every relay)
// with 1M rows waiting: the count(*) it used to run against relay.Admin.Backlog (capped
// count, primary-key endpoints, pg_stat_user_tables). Then again after the relays published
// the first half, whose dead tuples vacuum has not removed yet (the worst moment for any
// scan from the head of the table).
func benchStats(ctx context.Context, e *env) ([]result, error) {
	pool, schema, err := e.freshSchema(ctx, "stats")
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	const rows = 1_000_000
	if _, err := pool.Exec(ctx, `INSERT INTO outbox (event_id, topic, partition_key, key_hash, payload)
		SELECT gen_random_uuid(), 'bench', 'key-' || (g % 50), g % 64, $1::bytea FROM generate_series(1, $2) g`, benchPayload, rows); err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE outbox`); err != nil {
		return nil, err
	}
	admin, err := relay.NewAdmin(schema)
	if err != nil {
		return nil, err
	}
	countStar := func() error {
		var n int64
		var age float64
		return pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox),
			coalesce(extract(epoch FROM now() - (SELECT created_at FROM outbox ORDER BY id LIMIT 1)), 0)::float8`).Scan(&n, &age)
	}
	var last relay.Backlog
	backlog := func() error {
		var err error
		last, err = admin.Backlog(ctx, pool)
		return err
	}
	// The median of 7 runs after one warm-up, in milliseconds.
	median := func(f func() error) (float64, error) {
		var ds []time.Duration
		for i := range 8 {
			start := time.Now()
			if err := f(); err != nil {
				return 0, err
			}
			if i > 0 {
				ds = append(ds, time.Since(start))
			}
		}
		sortDurations(ds)
		return float64(ds[len(ds)/2].Microseconds()) / 1000, nil
	}
	var out []result
	measure := func(scenario string) error {
		c, err := median(countStar)
		if err != nil {
			return err
		}
		b, err := median(backlog)
		if err != nil {
			return err
		}
		out = append(out,
			result{Scenario: scenario, System: "count(*)", Value: c, Unit: "ms"},
			result{Scenario: scenario, System: "onceflow", Value: b, Unit: "ms", Target: fmt.Sprintf("estimate %d rows", last.Rows)})
		return nil
	}
	if err := measure("stats_1M"); err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, `DELETE FROM outbox WHERE id <= (SELECT min(id) FROM outbox) + $1`, rows/2-1); err != nil {
		return nil, err
	}
	if err := measure("stats_1M_half_published"); err != nil {
		return nil, err
	}
	return out, nil
}

func sortDurations(ds []time.Duration) {
	for i := 1; i < len(ds); i++ {
		for j := i; j > 0 && ds[j] < ds[j-1]; j-- {
			ds[j], ds[j-1] = ds[j-1], ds[j]
		}
	}
}
