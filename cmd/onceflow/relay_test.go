package main

import (
	"context"
	"io"
	"net"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
)

func TestRelayCommandReportsEveryBadSetting(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := map[string]string{"ONCEFLOW_RELAY_POLL_INTERVAL": "soon"} // and no DATABASE_URL, no KAFKA_BROKERS
	r := runCmd(ctx, env, "relay", "--schema", "Bad", "--shards", "0", "--batch-size", "-5", "--log-format", "xml").expect(t, "relay with bad settings", 1)
	for _, want := range []string{"ONCEFLOW_RELAY_POLL_INTERVAL", "DATABASE_URL", "invalid schema name", "BatchSize is -5", "--log-format", "no Kafka brokers"} {
		if !strings.Contains(r.stderr, want) {
			t.Errorf("output does not mention %q:\n%s", want, r.stderr)
		}
	}
	r = runCmd(ctx, nil, "relay", "-h").expect(t, "relay -h", 0)
	if !strings.Contains(r.stdout, "-kafka-brokers string") {
		t.Errorf("relay -h does not list the flags:\n%s", r.stderr)
	}
	runCmd(ctx, nil, "relay", "--nope").expect(t, "unknown flag", 2)
	// The listener's connection: a URL pgx cannot parse, or one given with --no-listen, is
	// refused with the rest, and its password is never shown.
	r = runCmd(ctx, map[string]string{"ONCEFLOW_LISTEN_DATABASE_URL": "postgres://u:s3cret-pw@h:notaport/db"}, "relay").expect(t, "bad listen URL", 1)
	if !strings.Contains(r.stderr, "--listen-database-url") || strings.Contains(r.stderr, "s3cret-pw") {
		t.Errorf("output does not name --listen-database-url, or shows its password:\n%s", r.stderr)
	}
	r = runCmd(ctx, nil, "relay", "--listen-database-url", "postgres://h/db", "--no-listen").expect(t, "listen URL and --no-listen", 1)
	if !strings.Contains(r.stderr, "--listen-database-url and --no-listen together") {
		t.Errorf("output does not refuse --listen-database-url with --no-listen:\n%s", r.stderr)
	}
}

// TestRelayCommandServesMetricsAndStopsCleanly runs the command in-process: it publishes,
// serves /healthz and /metrics, and returns exit 0 when its context (the signal) ends.
func TestRelayCommandServesMetricsAndStopsCleanly(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 1)
	if _, err := db.Pool.Exec(context.Background(), `INSERT INTO `+db.Schema+`.outbox (event_id, topic, key_hash, payload) VALUES (gen_random_uuid(), $1, 1, 'x')`, kafkatest.Topic("cmd")); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Port 0: the relay picks a free port and logs it, so no other process can take it first.
	inv := start(ctx, nil, "relay", "--database-url", db.URL, "--schema", db.Schema, "--kafka-brokers", strings.Join(brokers, ","),
		"--metrics-addr", "127.0.0.1:0", "--id", "cmd-test")
	addr := metricsAddr(t, inv)
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			return 0, err.Error()
		}
		defer func() { _ = resp.Body.Close() }()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		code, _ := get("/healthz")
		var left int
		if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+db.Schema+".outbox").Scan(&left); err != nil {
			t.Fatal(err)
		}
		if code == http.StatusOK && left == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("relay not healthy and drained within 60s (healthz %d, %d rows left):\n%s", code, left, inv.stderr.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	code, body := get("/metrics")
	if code != http.StatusOK {
		t.Fatalf("/metrics: %d", code)
	}
	for _, want := range []string{"onceflow_relay_owned_shards 64", "onceflow_relay_published_total 1", `onceflow_relay_errors_total{kind="transient"} 0`, "onceflow_relay_publish_seconds_bucket", "go_goroutines"} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	cancel()
	select {
	case code := <-inv.done:
		if code != 0 {
			t.Fatalf("relay exited %d after the signal, want 0:\n%s", code, inv.stderr.String())
		}
	case <-time.After(60 * time.Second):
		t.Fatal("relay did not stop within 60s of the signal")
	}
}

// metricsAddr waits for the relay's "serving metrics" log line and returns the address in it.
func metricsAddr(t *testing.T, inv *invocation) string {
	t.Helper()
	re := regexp.MustCompile(`msg="serving metrics" addr=(\S+)`)
	deadline := time.Now().Add(60 * time.Second)
	for {
		if m := re.FindStringSubmatch(inv.stderr.String()); m != nil {
			return m[1]
		}
		select {
		case code := <-inv.done:
			t.Fatalf("relay exited %d before serving metrics:\n%s", code, inv.stderr.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("relay did not serve metrics within 60s:\n%s", inv.stderr.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestOutboxCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	args := []string{"--database-url", db.URL, "--schema", db.Schema}
	outbox := func(a ...string) result {
		return runCmd(ctx, nil, append(append([]string{"outbox"}, a...), args...)...)
	}
	_, err := db.Pool.Exec(ctx, `
		INSERT INTO `+db.Schema+`.outbox (event_id, topic, partition_key, key_hash, payload, attempts, last_error)
		VALUES ('01939d3c-0000-7000-8000-000000000001', 'orders', 'k1', 1, 'pending', 2, 'MESSAGE_TOO_LARGE');
		INSERT INTO `+db.Schema+`.outbox_parked (id, event_id, topic, partition_key, key_hash, payload, created_at, attempts, last_error)
		VALUES (100, '01939d3c-0000-7000-8000-000000000100', 'orders', 'k2', 2, 'p100', now(), 10, 'INVALID_RECORD: rejected'),
		       (101, '01939d3c-0000-7000-8000-000000000101', 'payments', 'k3', 3, 'p101', now(), 10, 'too large')`)
	if err != nil {
		t.Fatal(err)
	}
	r := outbox("inspect").expect(t, "inspect", 0)
	for _, want := range []string{"pending: 1 rows", "1 refused at least once", "parked: 2", "orders", "MESSAGE_TOO_LARGE"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("inspect output lacks %q:\n%s", want, r.stdout)
		}
	}
	r = outbox("parked").expect(t, "parked", 0)
	if !strings.Contains(r.stdout, "INVALID_RECORD") || !strings.Contains(r.stdout, "01939d3c-0000-7000-8000-000000000101") {
		t.Errorf("parked output:\n%s", r.stdout)
	}

	// Bad input: a clear error and nothing changed.
	for _, bad := range [][]string{
		{"replay"},                       // no filter
		{"replay", "--event-id", "nope"}, // not a UUID
		{"replay", "--id", "1,x"},        // not an id
	} {
		outbox(bad...).expect(t, strings.Join(bad, " "), 1)
	}
	r = outbox("replay", "--topic", "orders", "--dry-run").expect(t, "dry run", 0)
	if !strings.Contains(r.stdout, "1 parked rows would be replayed") {
		t.Fatalf("dry run:\n%s", r.stdout)
	}
	countParked := func() int {
		var n int
		if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM "+db.Schema+".outbox_parked").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if parked := countParked(); parked != 2 {
		t.Fatalf("refused or dry-run replays changed the parked rows: %d left", parked)
	}
	r = outbox("replay", "--id", "100").expect(t, "replay", 0)
	if !strings.Contains(r.stdout, "1 parked rows moved back into the outbox") {
		t.Errorf("replay output:\n%s", r.stdout)
	}
	var eventID string
	var attempts int
	if err := db.Pool.QueryRow(ctx, "SELECT event_id::text, attempts FROM "+db.Schema+".outbox WHERE payload = 'p100'").Scan(&eventID, &attempts); err != nil {
		t.Fatalf("replayed row not in the outbox: %v", err)
	}
	if eventID != "01939d3c-0000-7000-8000-000000000100" || attempts != 0 {
		t.Fatalf("replayed row has event id %s, attempts %d", eventID, attempts)
	}
	outbox("replay", "--all").expect(t, "replay --all", 0)
	if parked := countParked(); parked != 0 {
		t.Fatalf("%d parked rows left after replay --all", parked)
	}
	r = runCmd(ctx, nil, "outbox", "sideways").expect(t, "unknown action", 2)
	if !strings.Contains(r.stderr, `unknown action "sideways"`) {
		t.Errorf("unknown action:\n%s", r.stderr)
	}
}

// TestRelayWaitsForDatabase: `onceflow relay` started while PostgreSQL is unreachable does not
// exit (under a supervisor that is a crash loop): it logs what it waits for, serves an
// unhealthy /healthz, and stops cleanly on SIGTERM (context cancellation here). Before, the
// start-up ping failed and it exited 1.
func TestRelayWaitsForDatabase(t *testing.T) {
	t.Parallel()
	brokers := kafkatest.Brokers(t, 1)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	metricsAddr := ln.Addr().String()
	_ = ln.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	inv := start(ctx, nil, "relay", "--database-url", "postgres://onceflow@127.0.0.1:1/shop?sslmode=disable",
		"--kafka-brokers", strings.Join(brokers, ","), "--metrics-addr", metricsAddr)
	var status int
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		resp, err := http.Get("http://" + metricsAddr + "/healthz")
		if err == nil {
			status = resp.StatusCode
			_ = resp.Body.Close()
			break
		}
		select {
		case code := <-inv.done:
			t.Fatalf("relay exited %d while the database was unreachable:\n%s", code, inv.stderr.String())
		case <-time.After(50 * time.Millisecond):
		}
	}
	if status != http.StatusServiceUnavailable {
		t.Fatalf("/healthz = %d while waiting for the database, want 503", status)
	}
	for !strings.Contains(inv.stderr.String(), "waiting for PostgreSQL") {
		select {
		case code := <-inv.done:
			t.Fatalf("relay exited %d:\n%s", code, inv.stderr.String())
		case <-time.After(50 * time.Millisecond):
		}
	}
	cancel()
	if code := <-inv.done; code != 0 {
		t.Fatalf("relay exited %d after cancellation, want 0:\n%s", code, inv.stderr.String())
	}
}
