package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/onceflow/onceflow/internal/testdb"
)

// seedStuck fills a schema with something of everything `onceflow status` looks at: pending
// rows whose oldest waits for 10 minutes (one refused twice), a parked row, a live relay
// holding 3 of 4 shards whose heartbeat is 2 minutes old, dedup rows past retention, a stuck
// saga. It returns the event ids of the refused pending row and of the parked row.
func seedStuck(t *testing.T, db *testdb.DB) (pending, parked string) {
	t.Helper()
	ctx := context.Background()
	pending, parked = uuid.Must(uuid.NewV7()).String(), uuid.Must(uuid.NewV7()).String()
	for _, sql := range []string{
		`INSERT INTO ` + db.Table("outbox") + ` (event_id, topic, partition_key, key_hash, payload, created_at, attempts, last_error)
			VALUES ('` + pending + `', 'orders', 'k1', 5, 'x', now() - interval '10 minutes', 2, 'broker said no'),
			       (gen_random_uuid(), 'orders', 'k2', 6, 'y', now() - interval '1 minute', 0, NULL),
			       (gen_random_uuid(), 'orders', '', 7, 'z', now(), 0, NULL)`,
		`INSERT INTO ` + db.Table("outbox_parked") + ` (id, event_id, topic, partition_key, key_hash, payload, created_at, attempts, last_error, parked_by)
			VALUES (1000, '` + parked + `', 'orders', 'k9', 9, 'p', now() - interval '1 hour', 5, 'message too large', 'relay-a')`,
		`INSERT INTO ` + db.Table("relay_member") + ` (id, host, pid, heartbeat_at, expires_at)
			VALUES ('relay-a', 'host-a', 42, now() - interval '2 minutes', now() + interval '1 minute')`,
		`INSERT INTO ` + db.Table("relay_lease") + ` (shard, owner, epoch, expires_at)
			VALUES (0, 'relay-a', 1, now() + interval '1 minute'), (1, 'relay-a', 1, now() + interval '1 minute'),
			       (2, 'relay-a', 1, now() + interval '1 minute'), (3, '', 0, 'epoch')`,
		`INSERT INTO ` + db.Table("processed_event") + ` (consumer, dedup_key, processed_at)
			SELECT 'billing', 'old-' || g, now() - interval '100 hours' FROM generate_series(1, 5) g`,
		`INSERT INTO ` + db.Table("processed_event") + ` (consumer, dedup_key) VALUES ('billing', 'event:` + pending + `')`,
		`INSERT INTO ` + db.Table("saga") + ` (id, name, version, state, data, steps, error)
			VALUES ('s-1', 'checkout', 1, 'stuck', '{}', '[]', 'refund failed'), ('s-2', 'checkout', 1, 'running', '{}', '[]', '')`,
	} {
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%v\n%s", err, sql)
		}
	}
	return pending, parked
}

func TestStatusCommand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	env := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema}

	// An empty schema: nothing is stuck.
	r := runCmd(ctx, env, "status").expect(t, "status on an empty schema", 0)
	if !strings.Contains(r.stdout, ": OK") || !strings.Contains(r.stdout, "0 pending") {
		t.Errorf("status on an empty schema:\n%s", r.stdout)
	}

	seedStuck(t, db)
	r = runCmd(ctx, env, "status", "--max-retention-backlog", "3").expect(t, "status with stuck items", exitStuck)
	for _, want := range []string{": STUCK", "3 pending", "oldest 10m", "parked: 1", "shards: 4, 1 without a live owner",
		"relay-a", "host-a", "last beat 2m", "waits for 10m", "1 row parked", "processed_event holds more than 3 rows past retention",
		"1 sagas stuck", "checkout  stuck", "checkout  running"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("status output lacks %q:\n%s", want, r.stdout)
		}
	}
	if !strings.Contains(r.stderr, "stuck:") {
		t.Errorf("stderr does not say why the exit status is 4:\n%s", r.stderr)
	}

	// --json, for scripts: the same figures, parseable.
	r = runCmd(ctx, env, "status", "--json", "--max-retention-backlog", "3").expect(t, "status --json", exitStuck)
	var rep statusReport
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil {
		t.Fatalf("status --json: %v\n%s", err, r.stdout)
	}
	if rep.OK || rep.Outbox.Pending != 3 || !rep.Outbox.PendingExact || rep.Outbox.Parked != 1 || rep.Outbox.OldestAgeSeconds < 590 ||
		len(rep.Relays) != 1 || rep.Relays[0].Shards != 3 || !rep.Relays[0].Live || rep.Shards != 4 || rep.ShardsUnowned != 1 ||
		len(rep.Problems) != 5 {
		t.Errorf("status --json: %+v", rep)
	}
	for _, tbl := range rep.Retention {
		want := map[string]int64{"processed_event": 4, "idempotency_record": 0, "saga": 0}[tbl.Table] // capped at threshold+1
		if tbl.Expired != want {
			t.Errorf("retention of %s: %d expired, want %d", tbl.Table, tbl.Expired, want)
		}
	}

	// Thresholds are the operator's: loose enough, the same schema is fine.
	runCmd(ctx, env, "status", "--max-oldest-age", "1h", "--max-parked", "1", "--max-heartbeat-age", "5m",
		"--max-stuck-sagas", "1").expect(t, "status with loose thresholds", 0)
	runCmd(ctx, env, "status", "--max-oldest-age", "0s", "--window", "soon").expect(t, "status with bad thresholds", 1)

	// --watch --json: one report per refresh until interrupted (the signal cancels the
	// context), then exit 0 whatever the last report said.
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	inv := start(wctx, env, "status", "--watch", "--json", "--interval", "20ms")
	for !strings.Contains(inv.stdout.String(), "}\n{") {
		select {
		case code := <-inv.done:
			t.Fatalf("status --watch exited %d before refreshing:\n%s%s", code, inv.stdout.String(), inv.stderr.String())
		case <-time.After(10 * time.Millisecond):
		}
	}
	cancel()
	if code := <-inv.done; code != 0 {
		t.Fatalf("status --watch exited %d after the interrupt, want 0:\n%s", code, inv.stderr.String())
	}
	for _, line := range strings.Split(strings.TrimSpace(inv.stdout.String()), "\n") {
		if err := json.Unmarshal([]byte(line), &rep); err != nil {
			t.Fatalf("status --watch --json line %q: %v", line, err)
		}
	}
}

func TestOutboxFindCommand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	env := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema}
	pending, parked := seedStuck(t, db)

	r := runCmd(ctx, env, "outbox", "find", pending, "--consumer", "billing").expect(t, "find a pending event", 0)
	for _, want := range []string{"event " + pending + ": pending", "orders", "k1", "broker said no", "relay-a",
		`inbox: consumer "billing" processed it`} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("find output lacks %q:\n%s", want, r.stdout)
		}
	}

	r = runCmd(ctx, env, "outbox", "find", "--json", parked, "--consumer", "shipping").expect(t, "find a parked event", 0)
	var f foundEvent
	if err := json.Unmarshal([]byte(r.stdout), &f); err != nil {
		t.Fatalf("find --json: %v\n%s", err, r.stdout)
	}
	if f.Where != "parked" || len(f.Parked) != 1 || f.Parked[0].LastError != "message too large" || f.Parked[0].Attempts != 5 ||
		f.Inbox == nil || f.Inbox.Processed || f.Inbox.DedupKey != "event:"+parked {
		t.Errorf("find --json of a parked event: %+v", f)
	}

	gone := uuid.Must(uuid.NewV7()).String()
	r = runCmd(ctx, env, "outbox", "find", gone).expect(t, "find a published event", 0)
	if !strings.Contains(r.stdout, ": gone") || !strings.Contains(r.stdout, "published") {
		t.Errorf("find of an event not in the outbox:\n%s", r.stdout)
	}
	runCmd(ctx, env, "outbox", "find", "not-a-uuid").expect(t, "find with a bad id", 1)
	runCmd(ctx, env, "outbox", "find").expect(t, "find without an id", 2)
}

// A saga running (or compensating) for longer than --max-saga-age is flagged, not only a
// stuck one: it waits for something (a relay, a participant) that the report should name.
func TestStatusFlagsLongRunningSagas(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	env := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("saga")+` (id, name, version, state, data, steps, created_at)
		VALUES ('s-old', 'checkout', 1, 'running', '{}', '[]', now() - interval '2 hours'),
		       ('s-older', 'checkout', 1, 'compensating', '{}', '[]', now() - interval '3 hours'),
		       ('s-new', 'checkout', 1, 'running', '{}', '[]', now())`); err != nil {
		t.Fatal(err)
	}
	r := runCmd(ctx, env, "status").expect(t, "status with sagas older than the default 1h", exitStuck)
	for _, want := range []string{": STUCK", "2 sagas running or compensating for longer than 1h0m0s", "the oldest, s-older (checkout), is compensating for 3h0m0s",
		"`onceflow saga show s-older`", "checkout  running       2      2h0m0s"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("status output lacks %q:\n%s", want, r.stdout)
		}
	}
	r = runCmd(ctx, env, "status", "--json").expect(t, "status --json", exitStuck)
	var rep statusReport
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil {
		t.Fatalf("status --json: %v\n%s", err, r.stdout)
	}
	if rep.SagasOverAge != 2 || rep.OldestSaga == nil || rep.OldestSaga.ID != "s-older" || rep.OldestSaga.AgeSeconds < 3*3600-60 {
		t.Errorf("status --json: sagas_over_age %d, oldest %+v", rep.SagasOverAge, rep.OldestSaga)
	}
	runCmd(ctx, env, "status", "--max-saga-age", "4h").expect(t, "status with --max-saga-age above every saga's age", 0)
	runCmd(ctx, env, "status", "--max-saga-age", "0").expect(t, "status with the saga age check off", 0)
	runCmd(ctx, env, "status", "--max-saga-age", "-1s").expect(t, "status with a negative --max-saga-age", 1)
}
