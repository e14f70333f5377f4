package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testdb"
)

// seedScheduled schedules five messages: one overdue by 10 minutes (event late), one due now,
// three due in 1, 2 and 3 hours (two of topic invoices).
func seedScheduled(t *testing.T, db *testdb.DB) (late string) {
	t.Helper()
	late = "0190b5a0-0000-7000-8000-0000000000aa"
	if _, err := db.Pool.Exec(context.Background(), `INSERT INTO `+db.Table("outbox_scheduled")+` (event_id, topic, partition_key, key_hash, payload, metadata, due_at)
		VALUES ($1, 'reminders', 'o-1', 1, 'x', '{"trace":"t1"}', now() - interval '10 minutes'),
		       (gen_random_uuid(), 'reminders', 'o-2', 2, 'xx', '{}', now()),
		       (gen_random_uuid(), 'invoices', 'o-3', 3, 'xxx', '{}', now() + interval '1 hour'),
		       (gen_random_uuid(), 'invoices', 'o-4', 4, 'xxx', '{}', now() + interval '2 hours'),
		       (gen_random_uuid(), 'reminders', 'o-5', 5, 'xxx', '{}', now() + interval '3 hours')`, late); err != nil {
		t.Fatal(err)
	}
	return late
}

func TestOutboxScheduledCommand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	env := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema}

	r := runCmd(ctx, env, "outbox", "scheduled").expect(t, "outbox scheduled on an empty table", 0)
	if !strings.Contains(r.stdout, "0 messages, 0 overdue") || !strings.Contains(r.stdout, "no scheduled messages") {
		t.Errorf("outbox scheduled on an empty table:\n%s", r.stdout)
	}
	late := seedScheduled(t, db)

	// The listing, in due order, two at a time: the cursor printed at the end of a page lists
	// the next.
	r = runCmd(ctx, env, "outbox", "scheduled", "--limit", "2").expect(t, "outbox scheduled --limit 2", 0)
	for _, want := range []string{"5 messages, 1 overdue", late, "overdue 10m", "  due  ", "more scheduled messages follow: add --after "} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("first page lacks %q:\n%s", want, r.stdout)
		}
	}
	if i, j := strings.Index(r.stdout, "o-1"), strings.Index(r.stdout, "o-2"); i < 0 || j < i || strings.Contains(r.stdout, "o-3") {
		t.Errorf("first page not the first two in due order:\n%s", r.stdout)
	}
	var pages []string
	after := ""
	for range 5 {
		args := []string{"outbox", "scheduled", "--limit", "2", "--json"}
		if after != "" {
			args = append(args, "--after", after)
		}
		r = runCmd(ctx, env, args...).expect(t, "outbox scheduled --json", 0)
		var page scheduledJSON
		if err := json.Unmarshal([]byte(r.stdout), &page); err != nil {
			t.Fatalf("outbox scheduled --json: %v\n%s", err, r.stdout)
		}
		for _, m := range page.Messages {
			pages = append(pages, m.Key)
		}
		if after = page.Next; after == "" {
			break
		}
	}
	if got := strings.Join(pages, ","); got != "o-1,o-2,o-3,o-4,o-5" {
		t.Errorf("pages of --json: %s", got)
	}
	r = runCmd(ctx, env, "outbox", "scheduled", "--topic", "invoices").expect(t, "outbox scheduled --topic", 0)
	if !strings.Contains(r.stdout, "o-3") || !strings.Contains(r.stdout, "o-4") || strings.Contains(r.stdout, "o-1") || !strings.Contains(r.stdout, "in 1h") {
		t.Errorf("outbox scheduled --topic invoices:\n%s", r.stdout)
	}

	// --count: the figures and the count by topic.
	r = runCmd(ctx, env, "outbox", "scheduled", "--count").expect(t, "outbox scheduled --count", 0)
	for _, want := range []string{"scheduled: 5 messages, 1 overdue", "next due:", "event " + late + " of topic reminders",
		"is one running on schema " + db.Schema, "reminders  3", "invoices   2"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("--count lacks %q:\n%s", want, r.stdout)
		}
	}
	r = runCmd(ctx, env, "outbox", "scheduled", "--count", "--all", "--json").expect(t, "outbox scheduled --count --all --json", 0)
	var c scheduledCountJSON
	if err := json.Unmarshal([]byte(r.stdout), &c); err != nil {
		t.Fatalf("--count --json: %v\n%s", err, r.stdout)
	}
	if c.Rows != 5 || !c.RowsExact || c.Overdue != 1 || !c.OverdueExact || c.NextEvent != late || c.NextDue == nil || time.Since(*c.NextDue) < 9*time.Minute ||
		len(c.PerTopic) != 2 || c.PerTopic[0] != (scheduledTopicJSON{Topic: "reminders", Rows: 3, NextDue: *c.NextDue}) || c.PerTopicOf != 0 {
		t.Errorf("--count --all --json: %+v", c)
	}

	// Find says scheduled and when; status reports the overdue message as stuck.
	r = runCmd(ctx, env, "outbox", "find", late).expect(t, "outbox find a scheduled event", 0)
	if !strings.Contains(r.stdout, "event "+late+": scheduled") || !strings.Contains(r.stdout, "SCHEDULED TOPIC") || !strings.Contains(r.stdout, "reminders") {
		t.Errorf("find a scheduled event:\n%s", r.stdout)
	}
	r = runCmd(ctx, env, "outbox", "find", "--json", late).expect(t, "outbox find --json a scheduled event", 0)
	var f foundEvent
	if err := json.Unmarshal([]byte(r.stdout), &f); err != nil || f.Where != "scheduled" || len(f.Scheduled) != 1 || f.Scheduled[0].Key != "o-1" {
		t.Errorf("find --json a scheduled event: %+v, %v", f, err)
	}
	r = runCmd(ctx, env, "status").expect(t, "status with a message 10 minutes overdue", exitStuck)
	for _, want := range []string{"scheduled: 5 messages, 1 overdue, the most by 10m", "s (event " + late + ")", "1 scheduled message is overdue", "onceflow relay --schema " + db.Schema} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("status lacks %q:\n%s", want, r.stdout)
		}
	}
	r = runCmd(ctx, env, "status", "--json", "--max-scheduled-overdue", "0").expect(t, "status --max-scheduled-overdue 0", 0)
	var rep statusReport
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil || rep.Scheduled.Rows != 5 || rep.Scheduled.Overdue != 1 ||
		rep.Scheduled.OldestOverdueEventID != late || rep.Scheduled.OldestOverdueSeconds < 590 {
		t.Errorf("status --json scheduled: %+v, %v", rep.Scheduled, err)
	}

	// Mistakes say what to do and read nothing.
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--after", "nope"}, "is not a cursor a listing printed"},
		{[]string{"--count", "--topic", "x"}, "--count counts every topic"},
		{[]string{"--all"}, "use it with --count"},
		{[]string{"--limit", "0"}, "--limit is 0"},
		{[]string{"extra"}, "unexpected arguments"},
	} {
		r = runCmd(ctx, env, append([]string{"outbox", "scheduled"}, tc.args...)...)
		if r.code == 0 || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("outbox scheduled %q: exit %d, stderr lacks %q:\n%s", tc.args, r.code, tc.want, r.stderr)
		}
	}
}
