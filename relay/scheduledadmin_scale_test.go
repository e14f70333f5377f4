package relay

import (
	"context"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/testdb"
)

// The costs at 1M scheduled rows of 200 B (1% of them overdue, 10 topics), each the median
// of 9 after a warm-up: the relays' per-tick counts (the metric) and the summary (status),
// the count by topic of the next rows (the console, `outbox scheduled --count`), pages, a
// topic filter, and the full count by topic (a whole-table scan). Loading takes about a minute, so it runs only when asked:
//
//	ONCEFLOW_SCHEDULED_SCALE=1 go test -run TestScheduledAdminScale -v ./relay/
func TestScheduledAdminScale(t *testing.T) {
	if os.Getenv("ONCEFLOW_SCHEDULED_SCALE") == "" {
		t.Skip("set ONCEFLOW_SCHEDULED_SCALE=1 to measure the scheduled admin reads at 1M rows")
	}
	ctx := context.Background()
	db := testdb.New(t)
	admin, err := NewAdmin(db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for _, sql := range []string{
		`INSERT INTO ` + db.Table("outbox_scheduled") + ` (event_id, topic, partition_key, key_hash, payload, due_at)
			SELECT gen_random_uuid(), 'topic-' || (g % 10), 'key-' || (g % 1000), g % 1000, convert_to(repeat('x', 200), 'UTF8'),
				CASE WHEN g % 100 = 0 THEN now() - interval '1 hour' ELSE now() + interval '1 day' END + (g % 3600) * interval '1 second'
			FROM generate_series(1, 1000000) g`,
		`VACUUM ANALYZE ` + db.Table("outbox_scheduled"),
	} {
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("loaded 1M scheduled rows in %s", time.Since(start).Round(time.Second))
	median := func(run func() error) time.Duration {
		_ = run()
		var d []time.Duration
		for range 9 {
			s := time.Now()
			if err := run(); err != nil {
				t.Fatal(err)
			}
			d = append(d, time.Since(s))
		}
		slices.Sort(d)
		return d[len(d)/2]
	}
	countsSQL, table := scheduledCountsSQL(db.Schema), pgsql.Table(db.Schema, "outbox_scheduled")
	var first ScheduledPage
	for _, m := range []struct {
		name string
		run  func() error
	}{
		{"relay metric counts (per stats tick)", func() error { _, err := readScheduledCounts(ctx, db.Pool, countsSQL, table); return err }},
		{"ScheduledSummary", func() error { _, err := admin.ScheduledSummary(ctx, db.Pool); return err }},
		{"ScheduledPerTopic, the next 10,000", func() error { _, err := admin.ScheduledPerTopic(ctx, db.Pool, ScheduledSample); return err }},
		{"Scheduled, first page of 100", func() error {
			first, err = admin.Scheduled(ctx, db.Pool, ScheduledFilter{})
			return err
		}},
		{"Scheduled, page of 100 after the first", func() error {
			_, err := admin.Scheduled(ctx, db.Pool, ScheduledFilter{After: first.Next})
			return err
		}},
		{"Scheduled, topic filter (10% of rows)", func() error {
			_, err := admin.Scheduled(ctx, db.Pool, ScheduledFilter{Topic: "topic-3"})
			return err
		}},
		{"Scheduled, topic filter (no match)", func() error {
			_, err := admin.Scheduled(ctx, db.Pool, ScheduledFilter{Topic: "nosuch"})
			return err
		}},
		{"Find a scheduled event", func() error { _, err := admin.Find(ctx, db.Pool, first.Messages[0].EventID); return err }},
		{"ScheduledPerTopic (full scan)", func() error { _, err := admin.ScheduledPerTopic(ctx, db.Pool, 0); return err }},
	} {
		t.Logf("SCHEDULED %-40s median of 9: %s", m.name, median(m.run).Round(10*time.Microsecond))
	}
}
