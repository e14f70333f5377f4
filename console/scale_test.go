package console_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/onceflow/onceflow/console"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/saga"
	"github.com/onceflow/onceflow/status"
)

// The console's server time at scale: 1M sagas (20k stuck, 10k running, the rest finished
// over the last 11 days), 1M pending outbox rows and 100k poison rows (90k of them replayed
// history); each page rendered 20 times, the median reported beside the status read
// (status.Read, what `onceflow status` runs). Seeding takes a few minutes, so it
// runs only when asked:
//
//	ONCEFLOW_CONSOLE_SCALE=1 go test -run TestConsoleScale -v ./console/
func TestConsoleScale(t *testing.T) {
	if os.Getenv("ONCEFLOW_CONSOLE_SCALE") == "" {
		t.Skip("set ONCEFLOW_CONSOLE_SCALE=1 to measure the console at 1M sagas")
	}
	ctx := context.Background()
	db := testdb.New(t)
	start := time.Now()
	steps := `'[{"name":"reserve","status":"done","attempts":1,"sent":[{"phase":"action","attempt":1,"topic":"reserve","event_id":"01939d3c-0000-7000-8000-000000000001","at":"2026-01-01T00:00:00Z"}]},{"name":"charge","status":"running","attempts":1}]'`
	for _, sql := range []string{
		`INSERT INTO ` + db.Table("saga") + ` (id, name, version, state, step, data, steps, error, created_at, finished_at)
			SELECT 'saga-' || lpad(g::text, 7, '0'), 'checkout', 1,
				CASE WHEN g % 50 = 0 THEN 'stuck' WHEN g % 100 = 1 THEN 'running' WHEN g % 20 = 2 THEN 'compensated' ELSE 'completed' END,
				1, '{"order":"x"}', ` + steps + `::jsonb, CASE WHEN g % 50 = 0 THEN 'compensation failed: stock service unavailable' ELSE '' END,
				now() - (1000000 - g) * interval '1 second',
				CASE WHEN g % 50 <> 0 AND g % 100 <> 1 THEN now() - (1000000 - g) * interval '1 second' END
			FROM generate_series(1, 1000000) g`,
		`INSERT INTO ` + db.Table("outbox") + ` (event_id, topic, partition_key, key_hash, payload, created_at)
			SELECT gen_random_uuid(), 'topic-' || (g % 10), 'key-' || (g % 1000), g % 1000, '{"n":1}', now() - interval '1 minute'
			FROM generate_series(1, 1000000) g`,
		`INSERT INTO ` + db.Table("inbox_poison") + ` (consumer, dedup_key, message_uuid, source, payload, attempts, error, state, replayed_at)
			SELECT 'consumer-' || (g % 5), 'k-' || g, gen_random_uuid()::text, 'orders/0@' || g, '{"n":1}', 5, 'boom',
				CASE WHEN g % 10 = 0 THEN 'poison' ELSE 'replayed' END, CASE WHEN g % 10 <> 0 THEN now() END
			FROM generate_series(1, 100000) g`,
		// A running saga waiting for the reply to a command no longer in the outbox (published):
		// its page looks the command up by event id.
		`UPDATE ` + db.Table("saga") + ` SET waiting = 'reply', steps = '[{"name":"reserve","status":"done","attempts":1},{"name":"charge","status":"running","attempts":1,"sent":[{"phase":"action","attempt":1,"topic":"charge","event_id":"01939d3c-0000-7000-8000-000000000002","at":"2026-01-01T00:00:00Z"}]}]'
			WHERE id = 'saga-0500001'`,
		// A thousand operator actions, one on the saga whose page is measured.
		`INSERT INTO ` + db.Table("operator_action") + ` (actor, action, targets, outcome)
			SELECT 'ops', 'saga retry', ARRAY['saga-' || lpad((g * 50)::text, 7, '0')], 'requested' FROM generate_series(1, 1000) g`,
		// What autovacuum does to a table soon after a bulk load: statistics and the
		// visibility map (index-only scans).
		`VACUUM ANALYZE ` + db.Table("saga"),
		`VACUUM ANALYZE ` + db.Table("outbox"),
		`VACUUM ANALYZE ` + db.Table("inbox_poison"),
	} {
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("seeded in %s", time.Since(start).Round(time.Second))
	if os.Getenv("ONCEFLOW_CONSOLE_SCALE") == "explain" {
		for _, q := range []string{
			`SELECT name, state, count(*), extract(epoch FROM now() - min(created_at))::float8 FROM ` + db.Table("saga") + `
				WHERE state IN ('running', 'compensating', 'stuck') GROUP BY name, state ORDER BY name, state`,
			`SELECT id FROM ` + db.Table("saga") + ` ORDER BY created_at DESC, id DESC LIMIT 101`,
			`SELECT id FROM ` + db.Table("inbox_poison") + ` ORDER BY id DESC LIMIT 100`,
		} {
			rows, err := db.Pool.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS) "+q)
			if err != nil {
				t.Fatal(err)
			}
			for rows.Next() {
				var line string
				_ = rows.Scan(&line)
				t.Log(line)
			}
			rows.Close()
		}
	}

	h, err := console.New(console.Config{DB: db.Pool, Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	// The cursor 10,000 stuck sagas deep, by walking the keyset pages.
	admin, _ := saga.NewAdmin(db.Schema)
	f := saga.ListFilter{State: saga.StateStuck, Limit: 1000}
	for range 10 {
		p, err := admin.ListPage(ctx, db.Pool, f)
		if err != nil || p.Next == "" {
			t.Fatalf("walking the stuck sagas: %v", err)
		}
		f.After = p.Next
	}
	median := func(run func()) time.Duration {
		var d []time.Duration
		for range 20 {
			s := time.Now()
			run()
			d = append(d, time.Since(s))
		}
		slices.Sort(d)
		return d[len(d)/2]
	}
	page := func(path string) func() {
		return func() {
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
			if rec.Code != http.StatusOK {
				t.Fatalf("%s: %d\n%s", path, rec.Code, rec.Body.String())
			}
		}
	}
	th := status.DefaultThresholds()
	for _, m := range []struct {
		name string
		run  func()
	}{
		{"status (status.Read)", func() {
			if _, err := status.Read(ctx, db.Pool, db.Schema, th); err != nil {
				t.Fatal(err)
			}
		}},
		{"overview", page("/")},
		{"sagas state=stuck, first page", page("/sagas?state=stuck")},
		{"sagas state=stuck, 10,000 deep", page("/sagas?state=stuck&after=" + url.QueryEscape(f.After))},
		{"sagas, no filter, first page", page("/sagas")},
		{"saga page", page("/sagas/saga-0500000")},
		{"saga page, waiting for a reply", page("/sagas/saga-0500001")},
		{"sagas step=charge state=running", page("/sagas?state=running&step=charge")},
		{"sagas error=unavailable", page("/sagas?error=unavailable")},
		{"sagas id=saga-05", page("/sagas?id=saga-05")},
		{"sagas step=nosuch (no match)", page("/sagas?step=nosuch")},
		{"sagas error=nosuch (no match)", page("/sagas?error=nosuch")},
		{"audit", page("/audit")},
		{"outbox", page("/outbox")},
		{"inbox poison", page("/inbox")},
	} {
		t.Logf("CONSOLE %-32s median of 20: %s", m.name, median(m.run).Round(10*time.Microsecond))
	}
}
