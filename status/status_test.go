package status_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/status"
)

// Read sees each table through its package's admin: a seeded schema shows every section, and
// each problem names what to do.
func TestRead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	th := status.DefaultThresholds()

	r, err := status.Read(ctx, db.Pool, db.Schema, th)
	if err != nil {
		t.Fatal(err)
	}
	if !r.OK || len(r.Problems) != 0 || r.Outbox.Pending != 0 || len(r.Relays) != 0 {
		t.Fatalf("an empty schema: %+v", r)
	}

	for _, sql := range []string{
		`INSERT INTO ` + db.Table("outbox") + ` (event_id, topic, partition_key, key_hash, payload, created_at)
			VALUES (gen_random_uuid(), 'orders', 'k1', 5, 'x', now() - interval '10 minutes')`,
		`INSERT INTO ` + db.Table("relay_member") + ` (id, host, pid, heartbeat_at, expires_at)
			VALUES ('relay-a', 'host-a', 42, now() - interval '2 minutes', now() + interval '1 minute'),
			       ('relay-b', 'host-b', 43, now() - interval '1 hour', now() - interval '59 minutes')`,
		`INSERT INTO ` + db.Table("relay_lease") + ` (shard, owner, epoch, expires_at)
			VALUES (0, 'relay-a', 1, now() + interval '1 minute'), (1, 'relay-b', 1, now() - interval '59 minutes')`,
		// Three dedup rows past the window, one of them a live saga's barrier row.
		`INSERT INTO ` + db.Table("processed_event") + ` (consumer, dedup_key, processed_at, saga_id)
			VALUES ('billing', 'a', now() - interval '100 hours', NULL), ('billing', 'b', now() - interval '100 hours', NULL),
			       ('billing', 'c', now() - interval '100 hours', 's-run')`,
		`INSERT INTO ` + db.Table("saga") + ` (id, name, version, state, data, steps, error, created_at)
			VALUES ('s-stuck', 'checkout', 1, 'stuck', '{}', '[]', 'refund failed', now()),
			       ('s-run', 'checkout', 1, 'running', '{}', '[]', '', now() - interval '3 hours')`,
		`INSERT INTO ` + db.Table("saga_timer") + ` (saga_id, kind, action, step, due_at)
			VALUES ('s-run', 'step', 'timeout', 0, now() - interval '10 minutes')`,
		`INSERT INTO ` + db.Table("inbox_poison") + ` (consumer, message_uuid, source, attempts, error, metadata, payload)
			VALUES ('billing', 'm1', 'orders', 5, 'card declined', '{}', 'x')`,
	} {
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%v\n%s", err, sql)
		}
	}
	r, err = status.Read(ctx, db.Pool, db.Schema, th)
	if err != nil {
		t.Fatal(err)
	}
	if r.OK || r.Outbox.Pending != 1 || r.Outbox.OldestAgeSeconds < 590 {
		t.Errorf("outbox: %+v", r.Outbox)
	}
	if r.Shards != 2 || r.ShardsUnowned != 1 || len(r.Relays) != 2 || !r.Relays[0].Live || r.Relays[0].Shards != 1 || r.Relays[1].Live {
		t.Errorf("relays: %d shards, %d unowned, %+v", r.Shards, r.ShardsUnowned, r.Relays)
	}
	if r.Retention[0].Table != "processed_event" || r.Retention[0].Expired != 2 || !r.Retention[0].Exact {
		t.Errorf("retention (the live saga's barrier row is not counted): %+v", r.Retention)
	}
	if len(r.Sagas) != 2 || r.Sagas[0].State != "running" || r.Sagas[1].State != "stuck" || r.Sagas[0].OldestAgeSeconds < 3*3600-60 {
		t.Errorf("sagas: %+v", r.Sagas)
	}
	if r.SagasOverAge != 1 || r.OldestSaga == nil || r.OldestSaga.ID != "s-run" {
		t.Errorf("long-running: %d, %+v", r.SagasOverAge, r.OldestSaga)
	}
	if r.OverdueTimers != 1 || r.OldestOverdue == nil || r.OldestOverdue.Name != "checkout" || r.OldestOverdue.OverdueSeconds < 590 {
		t.Errorf("overdue timers: %d, %+v", r.OverdueTimers, r.OldestOverdue)
	}
	if len(r.InboxPoison) != 1 || r.InboxPoison[0] != (status.Poison{Consumer: "billing", Count: 1}) {
		t.Errorf("poison: %+v", r.InboxPoison)
	}
	all := strings.Join(r.Problems, "\n")
	for _, want := range []string{"relay \"relay-a\" on host-a last beat", "waits for", "1 sagas stuck", "longer than 1h0m0s",
		"saga timers and operator requests are overdue", "1 inbox message given up as poison"} {
		if !strings.Contains(all, want) {
			t.Errorf("problems lack %q:\n%s", want, all)
		}
	}

	if _, err := status.Read(ctx, db.Pool, "bad-schema;", th); err == nil {
		t.Error("a bad schema name was accepted")
	}
	if _, err := status.Read(ctx, db.Pool, "nothing_here", th); err == nil || !strings.Contains(err.Error(), "onceflow migrate up --schema nothing_here") {
		t.Errorf("an unmigrated schema: %v", err)
	}
}

// The thresholds decide what is a problem: the same report passes with loose ones.
func TestThresholds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("saga")+` (id, name, version, state, data, steps, error)
		VALUES ('s-1', 'checkout', 1, 'stuck', '{}', '[]', 'refund failed')`); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		stuck int64
		ok    bool
	}{{"strict", 0, false}, {"loose", 1, true}} {
		th := status.DefaultThresholds()
		th.MaxStuckSagas = tc.stuck
		r, err := status.Read(ctx, db.Pool, db.Schema, th)
		if err != nil {
			t.Fatal(err)
		}
		if r.OK != tc.ok {
			t.Errorf("%s: OK %v, problems %q", tc.name, r.OK, r.Problems)
		}
	}
}

// Scheduled messages: rows due later are counted and change nothing else (not pending, not a
// problem, however many); a row overdue for longer than MaxScheduledOverdue is a problem that
// names it and says to start or upgrade a relay.
func TestScheduled(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("outbox_scheduled")+` (event_id, topic, key_hash, payload, due_at)
		SELECT gen_random_uuid(), 'reminders', g, 'x', now() + interval '1 day' FROM generate_series(1, 20000) g`); err != nil {
		t.Fatal(err)
	}
	th := status.DefaultThresholds()
	r, err := status.Read(ctx, db.Pool, db.Schema, th)
	if err != nil {
		t.Fatal(err)
	}
	s := r.Scheduled
	if !r.OK || r.Outbox.Pending != 0 || r.Outbox.OldestAgeSeconds != 0 || s.RowsExact || s.Rows <= 10_000 || s.Overdue != 0 ||
		!s.OverdueExact || s.OldestOverdueSeconds != 0 || s.NextDue == nil || time.Until(*s.NextDue) < 23*time.Hour {
		t.Fatalf("20k rows due tomorrow: %+v, problems %q", s, r.Problems)
	}

	const late = "0190b5a0-0000-7000-8000-0000000000aa"
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("outbox_scheduled")+` (event_id, topic, key_hash, payload, due_at)
		VALUES ($1, 'reminders', 1, 'x', now() - interval '2 minutes'), (gen_random_uuid(), 'reminders', 2, 'x', now() - interval '1 second')`, late); err != nil {
		t.Fatal(err)
	}
	if r, err = status.Read(ctx, db.Pool, db.Schema, th); err != nil {
		t.Fatal(err)
	}
	s = r.Scheduled
	if r.OK || s.Overdue != 1 || s.OldestOverdueEventID != late || s.OldestOverdueSeconds < 119 || s.NextDue == nil || time.Since(*s.NextDue) < 119*time.Second {
		t.Errorf("a row 2 minutes overdue: %+v", s)
	}
	if all := strings.Join(r.Problems, "\n"); len(r.Problems) != 1 || !strings.Contains(all, "1 scheduled message is overdue; the most overdue, event "+late+", was due 2m") ||
		!strings.Contains(all, "onceflow relay --schema "+db.Schema) {
		t.Errorf("problems: %q", r.Problems)
	}
	for _, lax := range []time.Duration{5 * time.Minute, 0} {
		th.MaxScheduledOverdue = lax
		if r, err = status.Read(ctx, db.Pool, db.Schema, th); err != nil || !r.OK {
			t.Errorf("MaxScheduledOverdue %s: %v, problems %q", lax, err, r.Problems)
		}
	}
}

// The retry lane: parked messages are counted per consumer, with their keys, the oldest and the
// next due; a key waiting longer than MaxLaneWait is a problem that names it and says what
// lists and retries them; a head due longer ago than MaxLaneLag says no process applies the
// lane. Zero thresholds switch the checks off.
func TestRetryLane(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	th := status.DefaultThresholds()
	park := func(consumer, lane, due, parked string) {
		t.Helper()
		var laneArg *string
		if lane != "" {
			laneArg = &lane
		}
		if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("inbox_parked")+` (consumer, topic, lane, dedup_key, message_uuid, payload, error, due_at, parked_at)
			VALUES ($1, 'orders', $2, gen_random_uuid()::text, gen_random_uuid()::text, 'x', 'provider down', now() + $3::interval, now() - $4::interval)`,
			consumer, laneArg, due, parked); err != nil {
			t.Fatal(err)
		}
	}
	park("billing", "o-1", "10 minutes", "20 minutes")
	park("billing", "o-2", "5 minutes", "5 minutes")
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("inbox_parked")+` (consumer, topic, lane, dedup_key, message_uuid, payload)
		VALUES ('billing', 'orders', 'o-1', 'behind', 'm-behind', 'x')`); err != nil {
		t.Fatal(err)
	}
	r, err := status.Read(ctx, db.Pool, db.Schema, th)
	if err != nil {
		t.Fatal(err)
	}
	if !r.OK || len(r.RetryLane) != 1 {
		t.Fatalf("a young retry lane: %+v, problems %q", r.RetryLane, r.Problems)
	}
	l := r.RetryLane[0]
	if l.Consumer != "billing" || l.Rows != 3 || !l.RowsExact || l.Keys != 2 || !l.KeysExact || l.OldestKey != "o-1" || l.OldestTopic != "orders" ||
		l.OldestAgeSeconds < 1190 || l.LagSeconds != 0 || l.NextDue == nil || time.Until(*l.NextDue) < 4*time.Minute {
		t.Errorf("billing's lane: %+v", l)
	}

	park("billing", "o-9", "-1 minute", "3 hours")
	park("audit", "", "-10 minutes", "15 minutes")
	if r, err = status.Read(ctx, db.Pool, db.Schema, th); err != nil {
		t.Fatal(err)
	}
	all := strings.Join(r.Problems, "\n")
	if r.OK || len(r.Problems) != 2 || len(r.RetryLane) != 2 || r.RetryLane[0].Consumer != "audit" || r.RetryLane[0].LagSeconds < 590 {
		t.Fatalf("an old key and an unapplied head: %+v, problems:\n%s", r.RetryLane, all)
	}
	for _, want := range []string{`key "o-9" (topic orders) of inbox consumer "billing" has waited 3h0m`, "in the retry lane (over 1h0m0s)",
		"The consumer has 4 messages of 3 keys parked", "provider it waits for may be down", "`onceflow inbox parked --consumer billing`",
		"`onceflow inbox parked release --consumer billing`",
		`a message of inbox consumer "audit"'s retry lane was due 10m`, "ago (over 5m0s)", "router.AddPlugin(ib.RouterPlugin)"} {
		if !strings.Contains(all, want) {
			t.Errorf("problems lack %q:\n%s", want, all)
		}
	}
	if strings.Contains(all, `"billing"'s retry lane was due`) {
		t.Errorf("billing's head due a minute ago is reported (under MaxLaneLag):\n%s", all)
	}
	th.MaxLaneWait, th.MaxLaneLag = 4*time.Hour, 0
	if r, err = status.Read(ctx, db.Pool, db.Schema, th); err != nil || !r.OK {
		t.Errorf("looser thresholds: %v, problems %q", err, r.Problems)
	}
	th.MaxLaneWait = 0
	park("audit", "", "1 minute", "30 hours")
	if r, err = status.Read(ctx, db.Pool, db.Schema, th); err != nil || !r.OK {
		t.Errorf("the checks off: %v, problems %q", err, r.Problems)
	}
	th.MaxLaneWait = time.Hour
	if r, err = status.Read(ctx, db.Pool, db.Schema, th); err != nil || !strings.Contains(strings.Join(r.Problems, "\n"), "a message without a key (topic orders, row ") {
		t.Errorf("a message without a key waiting 30 hours: %v, problems %q", err, r.Problems)
	}
}
