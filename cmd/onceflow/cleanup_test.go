package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testdb"
)

func TestCleanupCommand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	insert := func(n int, age time.Duration, tag string) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Schema+`.processed_event (consumer, dedup_key, processed_at)
			SELECT 'c', $3 || g, now() - make_interval(secs => $2) FROM generate_series(1, $1) g`, n, age.Seconds(), tag); err != nil {
			t.Fatal(err)
		}
	}
	count := func() (old, young int) {
		t.Helper()
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE processed_at < now() - interval '72 hours'),
			count(*) FILTER (WHERE processed_at >= now() - interval '72 hours') FROM `+db.Schema+`.processed_event`).Scan(&old, &young); err != nil {
			t.Fatal(err)
		}
		return old, young
	}
	insert(25, 80*time.Hour, "old-")
	insert(5, 2*time.Hour, "young-")
	base := []string{"cleanup", "--database-url", db.URL, "--schema", db.Schema}

	// Refused input changes nothing.
	for _, bad := range [][]string{
		{"--window", "1h"},
		{"--window", "soon"},
		{"--only", "nope"},
		{"--every", "1h", "--daily-at", "03:00"},
		{"--daily-at", "25:00"},
		{"--daily-at", "24:00"}, // midnight is 00:00
		{"--daily-at", "3am"},
		{"--every", "-1h"},
		{"--batch-size", "0"},
	} {
		if r := runCmd(ctx, nil, append(append([]string{}, base...), bad...)...); r.code != 1 {
			t.Errorf("%v exited %d, want 1:\n%s", bad, r.code, r.stderr)
		}
	}
	if r := runCmd(ctx, nil, append(append([]string{}, base...), "extra")...); r.code != 2 || !strings.Contains(r.stderr, "unexpected arguments") {
		t.Errorf("extra argument exited %d, want 2:\n%s", r.code, r.stderr)
	}
	if old, young := count(); old != 25 || young != 5 {
		t.Fatalf("refused runs deleted rows: %d old, %d young left", old, young)
	}

	// The default 72h window removes only the expired rows.
	r := runCmd(ctx, nil, append(append([]string{}, base...), "--batch-size", "10", "--only", "processed_event")...).expect(t, "cleanup", 0)
	if !strings.Contains(r.stdout, "processed_event: deleted 25 expired rows") {
		t.Errorf("cleanup does not report what it deleted:\n%s", r.stdout)
	}
	if old, young := count(); old != 0 || young != 5 {
		t.Fatalf("after cleanup: %d old, %d young rows; want 0 and 5", old, young)
	}
	// A short window needs the explicit override.
	runCmd(ctx, nil, append(append([]string{}, base...), "--window", "1h", "--allow-short-window")...).expect(t, "short window with override", 0)
	if _, young := count(); young != 0 {
		t.Fatalf("%d rows older than 1h survived", young)
	}

	// Scheduled mode keeps running until the context ends, then exits cleanly.
	insert(3, 2*time.Hour, "later-")
	sctx, cancel := context.WithCancel(ctx)
	inv := start(sctx, nil, append(append([]string{}, base...), "--window", "1h", "--allow-short-window", "--every", "20ms")...)
	deadline := time.Now().Add(time.Minute)
	for {
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Schema+`.processed_event`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("scheduled cleanup did not run:\n%s", inv.stderr.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	if code := <-inv.done; code != 0 {
		t.Fatalf("scheduled cleanup exited %d after cancel:\n%s", code, inv.stderr.String())
	}
}

func TestCleanupIdempotencyRecords(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Schema+`.idempotency_record (owner, idem_key, fingerprint, status, expires_at)
		SELECT 'u', 'k' || g, '\x00', 201, now() + CASE WHEN g <= 7 THEN interval '-1 minute' ELSE interval '1 hour' END
		FROM generate_series(1, 10) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Schema+`.processed_event (consumer, dedup_key, processed_at) VALUES ('c', 'old', now() - interval '100 hours')`); err != nil {
		t.Fatal(err)
	}
	runCmd(ctx, nil, "cleanup", "--database-url", db.URL, "--schema", db.Schema, "--only", "idempotency_record", "--batch-size", "3").expect(t, "cleanup", 0)
	var expired, live, processed int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE expires_at <= now()), count(*) FILTER (WHERE expires_at > now()),
		(SELECT count(*) FROM `+db.Schema+`.processed_event) FROM `+db.Schema+`.idempotency_record`).Scan(&expired, &live, &processed); err != nil {
		t.Fatal(err)
	}
	if expired != 0 || live != 3 || processed != 1 {
		t.Fatalf("after cleanup: %d expired, %d live records, %d processed_event rows; want 0, 3, 1 (--only respected)", expired, live, processed)
	}
}

// The schedule flags map onto the public retention constructors, with errors that say the
// expected form.
func TestCleanupScheduleFlags(t *testing.T) {
	t.Parallel()
	var out, errs strings.Builder
	cl := &cli{stdout: &out, stderr: &errs, getenv: func(string) string { return "" }}
	for _, c := range []struct {
		flag, value, want string
	}{
		{"--daily-at", "24:00", `--daily-at: retention: "24:00" is not a UTC time of day HH:MM from 00:00 (midnight) to 23:59, e.g. 03:00`},
		{"--every", "-1h", "--every is -1h0m0s; it must be positive"},
	} {
		err := cl.runCleanup(context.Background(), []string{"--database-url", "postgres://localhost:1/none", c.flag, c.value})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s %s: %v, want %q", c.flag, c.value, err, c.want)
		}
	}
}

// With the orchestrator in another database, --saga-database-url keeps the barrier rows of
// its sagas that are not finished; the others (finished, or without a saga row) and the plain
// dedup rows go. Without the flag this database's own saga table is asked, here empty.
func TestCleanupAsksTheOrchestratorsDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	participant, orders := testdb.New(t), testdb.New(t)
	if _, err := orders.Pool.Exec(ctx, `INSERT INTO `+orders.Table("saga")+` (id, name, version, state, data, steps, finished_at)
		VALUES ('live', 'checkout', 1, 'stuck', '{}', '[]', NULL), ('done', 'checkout', 1, 'completed', '{}', '[]', now())`); err != nil {
		t.Fatal(err)
	}
	seed := func() {
		t.Helper()
		if _, err := participant.Pool.Exec(ctx, `INSERT INTO `+participant.Table("processed_event")+` (consumer, dedup_key, processed_at, saga_id) VALUES
			('payments', 'saga-barrier:"live":"charge":action', now() - interval '100 hours', 'live'),
			('payments', 'saga-barrier:"done":"charge":action', now() - interval '100 hours', 'done'),
			('payments', 'saga-barrier:"gone":"charge":action', now() - interval '100 hours', 'gone'),
			('payments', 'event:1', now() - interval '100 hours', NULL)`); err != nil {
			t.Fatal(err)
		}
	}
	left := func() string {
		t.Helper()
		var keys string
		if err := participant.Pool.QueryRow(ctx, `SELECT coalesce(string_agg(dedup_key, ' ' ORDER BY dedup_key), '') FROM `+participant.Table("processed_event")).Scan(&keys); err != nil {
			t.Fatal(err)
		}
		return keys
	}
	seed()
	base := []string{"cleanup", "--only", "processed_event", "--database-url", participant.URL, "--schema", participant.Schema}
	withOrders := append(append([]string{}, base...), "--saga-database-url", orders.URL, "--saga-schema", orders.Schema)

	if r := runCmd(ctx, nil, append(append([]string{}, base...), "--saga-schema", orders.Schema)...); r.code != 1 || !strings.Contains(r.stderr, "--saga-schema without --saga-database-url") {
		t.Errorf("--saga-schema alone exited %d:\n%s", r.code, r.stderr)
	}
	r := runCmd(ctx, nil, append(withOrders, "--dry-run")...).expect(t, "dry run", 0)
	if !strings.Contains(r.stdout, "processed_event: 1 expired rows would be deleted") || !strings.Contains(r.stdout, "barrier rows not counted") {
		t.Errorf("the dry run does not say what it counts:\n%s", r.stdout)
	}
	runCmd(ctx, nil, withOrders...).expect(t, "cleanup", 0)
	if got := left(); got != `saga-barrier:"live":"charge":action` {
		t.Errorf("after cleanup with the orchestrator's database, left: %q; want only the live saga's barrier row", got)
	}
	runCmd(ctx, nil, base...).expect(t, "cleanup without the flag", 0)
	if got := left(); got != "" {
		t.Errorf("without --saga-database-url this database's (empty) saga table decides; left: %q", got)
	}
}
