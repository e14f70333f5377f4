package main

import (
	"context"
	"regexp"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/testdb"
)

// The operator surface tells the truth (issue 25, item 7): a replay that matches nothing
// fails and says so; a replay's dry run counts and lists ids; a replayed row is not reported
// stuck; cleanup has a dry run; --limit means one thing everywhere; saga list pages by
// cursor; saga -h is help on stdout.
func TestOperatorSurfaceTruth(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	env := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema}
	for _, sql := range []string{
		`INSERT INTO ` + db.Table("outbox_parked") + ` (id, event_id, topic, partition_key, key_hash, payload, created_at, attempts, last_error)
			SELECT 100 + g, gen_random_uuid(), 'orders', 'k', 1, 'p', now() - interval '3 hours', 10, 'too large' FROM generate_series(1, 3) g`,
		`INSERT INTO ` + db.Table("processed_event") + ` (consumer, dedup_key, processed_at)
			SELECT 'billing', 'old-' || g, now() - interval '100 hours' FROM generate_series(1, 7) g`,
		`INSERT INTO ` + db.Table("saga") + ` (id, name, version, state, data, steps, created_at)
			SELECT 's-' || g, 'checkout', 1, 'stuck', '{}', '[]', now() - g * interval '1 minute' FROM generate_series(1, 5) g`,
	} {
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}

	r := runCmd(ctx, env, "outbox", "replay", "--topic", "ordres").expect(t, "replay of a mistyped topic", 1)
	if !strings.Contains(r.stderr, `no parked row matches --topic "ordres": nothing moved`) {
		t.Errorf("replay of a mistyped topic:\n%s", r.stderr)
	}
	runCmd(ctx, env, "outbox", "replay", "--id", "0").expect(t, "replay --id 0", 1)
	runCmd(ctx, env, "outbox", "replay", "--topic", "ordres", "--dry-run").expect(t, "dry run of a mistyped topic", 1)
	r = runCmd(ctx, env, "outbox", "replay", "--topic", "orders", "--dry-run").expect(t, "dry run", 0)
	if !strings.Contains(r.stdout, "3 parked rows would be replayed (dry run: nothing changed); ids: 101, 102, 103") {
		t.Errorf("dry run:\n%s", r.stdout)
	}
	runCmd(ctx, env, "outbox", "replay", "--topic", "orders").expect(t, "replay", 0)
	// The replayed rows wait for a relay: their age is since the replay, not since they
	// were first written three hours ago.
	r = runCmd(ctx, env, "status", "--json", "--max-stuck-sagas", "10", "--max-oldest-age", "1h").expect(t, "status after a replay", 4)
	if strings.Contains(r.stdout, "waits for") || strings.Contains(r.stderr, "oldest pending row") {
		t.Errorf("status calls the replayed rows stuck:\n%s\n%s", r.stdout, r.stderr)
	}

	r = runCmd(ctx, env, "cleanup", "--dry-run", "--only", "processed_event").expect(t, "cleanup --dry-run", 0)
	if !strings.Contains(r.stdout, "processed_event: 7 expired rows would be deleted (dry run: nothing deleted)") {
		t.Errorf("cleanup --dry-run:\n%s", r.stdout)
	}
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Table("processed_event")).Scan(&n); err != nil || n != 7 {
		t.Fatalf("cleanup --dry-run deleted rows: %d left (%v)", n, err)
	}
	runCmd(ctx, env, "cleanup", "--dry-run", "--every", "1h").expect(t, "cleanup --dry-run --every", 1)

	for _, args := range [][]string{{"saga", "list"}, {"outbox", "inspect"}, {"outbox", "parked"}, {"inbox", "poison"}} {
		for _, limit := range []string{"0", "1001"} {
			r := runCmd(ctx, env, append(args, "--limit", limit)...).expect(t, strings.Join(args, " ")+" --limit "+limit, 1)
			if !strings.Contains(r.stderr, "must be between 1 and 1000") {
				t.Errorf("%s --limit %s:\n%s", strings.Join(args, " "), limit, r.stderr)
			}
		}
	}

	// saga list pages: 2 + 2 + 1, newest first, each saga once.
	var seen []string
	args := []string{"saga", "list", "--state", "stuck", "--limit", "2"}
	next := regexp.MustCompile(`--after (\S+) for the next page`)
	for page := 0; page < 5; page++ {
		r := runCmd(ctx, env, args...).expect(t, "saga list page", 0)
		seen = append(seen, regexp.MustCompile(`(?m)^(s-\d)\s`).FindAllString(r.stdout, -1)...)
		m := next.FindStringSubmatch(r.stdout)
		if m == nil {
			break
		}
		args = []string{"saga", "list", "--state", "stuck", "--limit", "2", "--after", m[1]}
	}
	if got := strings.Join(strings.Fields(strings.Join(seen, " ")), " "); got != "s-1 s-2 s-3 s-4 s-5" {
		t.Errorf("saga list pages: %q", got)
	}
	runCmd(ctx, env, "saga", "list", "--after", "garbage!").expect(t, "saga list with a bad cursor", 1)

	r = runCmd(ctx, env, "saga", "-h").expect(t, "saga -h", 0)
	if !strings.Contains(r.stdout, "Usage: onceflow saga") || r.stderr != "" {
		t.Errorf("saga -h:\nstdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	}
}
