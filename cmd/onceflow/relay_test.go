package main

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
)

// captureStderr runs f with os.Stderr redirected and returns what it printed.
func captureStderr(t *testing.T, f func()) string {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	old := os.Stderr
	os.Stderr = w
	done := make(chan string)
	go func() { b, _ := io.ReadAll(r); done <- string(b) }()
	f()
	os.Stderr = old
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return <-done
}

func TestRelayCommandReportsEveryBadSetting(t *testing.T) {
	t.Setenv("DATABASE_URL", "")
	t.Setenv("KAFKA_BROKERS", "")
	t.Setenv("ONCEFLOW_RELAY_POLL_INTERVAL", "soon")
	var code int
	out := captureStderr(t, func() {
		code = run(context.Background(), []string{"relay", "--schema", "Bad", "--shards", "0", "--batch-size", "-5", "--log-format", "xml"})
	})
	if code != 1 {
		t.Fatalf("exit %d, want 1", code)
	}
	for _, want := range []string{"ONCEFLOW_RELAY_POLL_INTERVAL", "DATABASE_URL", "invalid schema name", "BatchSize is -5", "--log-format", "no Kafka brokers"} {
		if !strings.Contains(out, want) {
			t.Errorf("output does not mention %q:\n%s", want, out)
		}
	}
	if code := run(context.Background(), []string{"relay", "-h"}); code != 0 {
		t.Fatalf("relay -h exited %d", code)
	}
	if code := run(context.Background(), []string{"relay", "--nope"}); code != 2 {
		t.Fatalf("unknown flag exited %d, want 2", code)
	}
}

// TestRelayCommandServesMetricsAndStopsCleanly runs the command in-process: it publishes,
// serves /healthz and /metrics, and returns exit 0 when its context (the signal) ends.
func TestRelayCommandServesMetricsAndStopsCleanly(t *testing.T) {
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 1)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	if err := ln.Close(); err != nil { // free the port for the relay's metrics server
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(context.Background(), `INSERT INTO outbox (event_id, topic, key_hash, payload) VALUES (gen_random_uuid(), $1, 1, 'x')`, kafkatest.Topic("cmd")); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	codec := make(chan int, 1)
	go func() {
		codec <- run(ctx, []string{"relay", "--database-url", db.URL, "--schema", db.Schema, "--kafka-brokers", strings.Join(brokers, ","),
			"--metrics-addr", addr, "--log-level", "warn", "--id", "cmd-test"})
	}()
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
		if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM outbox").Scan(&left); err != nil {
			t.Fatal(err)
		}
		if code == http.StatusOK && left == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("relay not healthy and drained within 60s (healthz %d, %d rows left)", code, left)
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
	case code := <-codec:
		if code != 0 {
			t.Fatalf("relay exited %d after the signal, want 0", code)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("relay did not stop within 60s of the signal")
	}
}

func TestOutboxCommands(t *testing.T) {
	ctx := context.Background()
	db := testdb.New(t)
	var buf bytes.Buffer
	stdout = &buf
	defer func() { stdout = os.Stdout }()
	args := []string{"--database-url", db.URL, "--schema", db.Schema}
	_, err := db.Pool.Exec(ctx, `
		INSERT INTO outbox (event_id, topic, partition_key, key_hash, payload, attempts, last_error)
		VALUES ('01939d3c-0000-7000-8000-000000000001', 'orders', 'k1', 1, 'pending', 2, 'MESSAGE_TOO_LARGE');
		INSERT INTO outbox_parked (id, event_id, topic, partition_key, key_hash, payload, created_at, attempts, last_error)
		VALUES (100, '01939d3c-0000-7000-8000-000000000100', 'orders', 'k2', 2, 'p100', now(), 10, 'INVALID_RECORD: rejected'),
		       (101, '01939d3c-0000-7000-8000-000000000101', 'payments', 'k3', 3, 'p101', now(), 10, 'too large')`)
	if err != nil {
		t.Fatal(err)
	}
	if code := run(ctx, append([]string{"outbox", "inspect"}, args...)); code != 0 {
		t.Fatalf("inspect exited %d", code)
	}
	for _, want := range []string{"pending: 1 rows", "1 refused at least once", "parked: 2", "orders", "MESSAGE_TOO_LARGE"} {
		if !strings.Contains(buf.String(), want) {
			t.Errorf("inspect output lacks %q:\n%s", want, buf.String())
		}
	}
	buf.Reset()
	if code := run(ctx, append([]string{"outbox", "parked"}, args...)); code != 0 {
		t.Fatalf("parked exited %d", code)
	}
	if !strings.Contains(buf.String(), "INVALID_RECORD") || !strings.Contains(buf.String(), "01939d3c-0000-7000-8000-000000000101") {
		t.Errorf("parked output:\n%s", buf.String())
	}

	// Bad input: a clear error and nothing changed.
	for _, bad := range [][]string{
		{"outbox", "replay"},                       // no filter
		{"outbox", "replay", "--event-id", "nope"}, // not a UUID
		{"outbox", "replay", "--id", "1,x"},        // not an id
	} {
		if code := run(ctx, append(bad, args...)); code != 1 {
			t.Fatalf("%v exited %d, want 1", bad, code)
		}
	}
	buf.Reset()
	if code := run(ctx, append([]string{"outbox", "replay", "--topic", "orders", "--dry-run"}, args...)); code != 0 || !strings.Contains(buf.String(), "1 parked rows would be replayed") {
		t.Fatalf("dry run exited %d:\n%s", code, buf.String())
	}
	countParked := func() int {
		var n int
		if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM outbox_parked").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if parked := countParked(); parked != 2 {
		t.Fatalf("refused or dry-run replays changed the parked rows: %d left", parked)
	}
	buf.Reset()
	if code := run(ctx, append([]string{"outbox", "replay", "--id", "100"}, args...)); code != 0 {
		t.Fatalf("replay exited %d", code)
	}
	var eventID string
	var attempts int
	if err := db.Pool.QueryRow(ctx, "SELECT event_id::text, attempts FROM outbox WHERE payload = 'p100'").Scan(&eventID, &attempts); err != nil {
		t.Fatalf("replayed row not in the outbox: %v", err)
	}
	if eventID != "01939d3c-0000-7000-8000-000000000100" || attempts != 0 {
		t.Fatalf("replayed row has event id %s, attempts %d", eventID, attempts)
	}
	if code := run(ctx, append([]string{"outbox", "replay", "--all"}, args...)); code != 0 {
		t.Fatalf("replay --all exited %d", code)
	}
	if parked := countParked(); parked != 0 {
		t.Fatalf("%d parked rows left after replay --all", parked)
	}
	if code := run(ctx, []string{"outbox", "sideways"}); code != 2 {
		t.Fatalf("unknown action exited %d, want 2", code)
	}
}
