package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"time"

	"github.com/onceflow/onceflow/console"
	"github.com/onceflow/onceflow/saga"
	"github.com/onceflow/onceflow/status"
)

// benchConsole measures the operator console's server time (issues 25 and 35): with 1M sagas
// (20k stuck, 10k running, the rest finished over 11 days), 1M pending outbox rows and 100k
// poison rows (90k of them replayed history), the overview, the saga list filtered by state
// (first page, and a page 10,000 rows deep by keyset) and by a step no saga is at (no index
// answers it), a saga's page, the page of a saga whose command still waits behind the 1M older
// outbox rows (found through the transaction the saga row records), and the audit trail, each the median of 20 renders,
// beside `onceflow status`'s own read (status.Read) in the same run. Target: ≤ 50 ms
// each.
func benchConsole(ctx context.Context, e *env) ([]result, error) {
	pool, schema, err := e.freshSchema(ctx, "console")
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	steps := `'[{"name":"reserve","status":"done","attempts":1,"sent":[{"phase":"action","attempt":1,"topic":"reserve","event_id":"01939d3c-0000-7000-8000-000000000001","at":"2026-01-01T00:00:00Z"}]},{"name":"charge","status":"running","attempts":1}]'`
	for _, sql := range []string{
		`INSERT INTO saga (id, name, version, state, step, data, steps, error, created_at, finished_at)
			SELECT 'saga-' || lpad(g::text, 7, '0'), 'checkout', 1,
				CASE WHEN g % 50 = 0 THEN 'stuck' WHEN g % 100 = 1 THEN 'running' WHEN g % 20 = 2 THEN 'compensated' ELSE 'completed' END,
				1, '{"order":"x"}', ` + steps + `::jsonb, CASE WHEN g % 50 = 0 THEN 'compensation failed: stock service unavailable' ELSE '' END,
				now() - (1000000 - g) * interval '1 second',
				CASE WHEN g % 50 <> 0 AND g % 100 <> 1 THEN now() - (1000000 - g) * interval '1 second' END
			FROM generate_series(1, 1000000) g`,
		`INSERT INTO outbox (event_id, topic, partition_key, key_hash, payload, created_at)
			SELECT gen_random_uuid(), 'topic-' || (g % 10), 'key-' || (g % 1000), g % 1000, '{"n":1}', now() - interval '1 minute'
			FROM generate_series(1, 1000000) g`,
		`INSERT INTO inbox_poison (consumer, dedup_key, message_uuid, source, payload, attempts, error, state, replayed_at)
			SELECT 'consumer-' || (g % 5), 'k-' || g, gen_random_uuid()::text, 'orders/0@' || g, '{"n":1}', 5, 'boom',
				CASE WHEN g % 10 = 0 THEN 'poison' ELSE 'replayed' END, CASE WHEN g % 10 <> 0 THEN now() END
			FROM generate_series(1, 100000) g`,
		// The waiting saga's command still pending behind the 1M older rows, recorded as the
		// orchestrator records it (migration 0019: the command's event id and transaction).
		`WITH cmd AS (INSERT INTO outbox (event_id, topic, partition_key, key_hash, payload)
				VALUES ('01939d3c-0000-7000-8000-000000000002', 'charge', 'saga-0500001', 1, '{}') RETURNING tx)
			UPDATE saga SET waiting = 'reply', command_event = '01939d3c-0000-7000-8000-000000000002', command_tx = (SELECT tx FROM cmd),
				steps = '[{"name":"reserve","status":"done","attempts":1},{"name":"charge","status":"running","attempts":1,"sent":[{"phase":"action","attempt":1,"topic":"charge","event_id":"01939d3c-0000-7000-8000-000000000002","at":"2026-01-01T00:00:00Z"}]}]'
			WHERE id = 'saga-0500001'`,
		`INSERT INTO operator_action (actor, action, targets, outcome)
			SELECT 'ops', 'saga retry', ARRAY['saga-' || lpad((g * 50)::text, 7, '0')], 'requested' FROM generate_series(1, 1000) g`,
		`VACUUM ANALYZE saga`, `VACUUM ANALYZE outbox`, `VACUUM ANALYZE inbox_poison`,
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			return nil, err
		}
	}
	h, err := console.New(console.Config{DB: pool, Schema: schema})
	if err != nil {
		return nil, err
	}
	admin, err := saga.NewAdmin(schema)
	if err != nil {
		return nil, err
	}
	// The cursor 10,000 stuck sagas deep, reached by walking the keyset pages.
	f := saga.ListFilter{State: saga.StateStuck, Limit: 1000}
	for range 10 {
		p, err := admin.ListPage(ctx, pool, f)
		if err != nil {
			return nil, err
		}
		f.After = p.Next
	}
	page := func(path string) func() error {
		return func() error {
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
			if rec.Code != http.StatusOK {
				return fmt.Errorf("console %s: status %d", path, rec.Code)
			}
			return nil
		}
	}
	// The median of 20 runs after one warm-up, in milliseconds.
	median := func(f func() error) (float64, error) {
		var ds []time.Duration
		for i := range 21 {
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
	for _, m := range []struct {
		system string
		run    func() error
	}{
		{"status", func() error {
			_, err := status.Read(ctx, pool, schema, status.DefaultThresholds())
			return err
		}},
		{"overview", page("/")},
		{"saga_list_stuck", page("/sagas?state=stuck")},
		{"saga_list_10k_deep", page("/sagas?state=stuck&after=" + url.QueryEscape(f.After))},
		{"saga_page", page("/sagas/saga-0500000")},
		{"saga_page_waiting", page("/sagas/saga-0500001")},
		{"saga_list_step_nomatch", page("/sagas?step=nosuch")},
		{"audit", page("/audit")},
	} {
		ms, err := median(m.run)
		if err != nil {
			return nil, err
		}
		r := result{Scenario: "console", System: m.system, Value: ms, Unit: "ms", Versus: "-", Target: "≤ 50 ms"}
		if m.system == "status" {
			r.Target = "onceflow status's read"
		}
		out = append(out, r)
	}
	return out, nil
}
