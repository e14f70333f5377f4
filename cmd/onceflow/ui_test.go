package main

import (
	"context"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testdb"
)

var uiURL = regexp.MustCompile(`at (http://[^ ]+/) `)

// startUI runs `onceflow ui` until the test ends and returns its URL.
func startUI(t *testing.T, env map[string]string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	inv := start(ctx, env, append([]string{"ui"}, args...)...)
	t.Cleanup(func() {
		cancel()
		if code := <-inv.done; code != 0 {
			t.Errorf("onceflow ui exited %d after the interrupt:\n%s", code, inv.stderr.String())
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		if m := uiURL.FindStringSubmatch(inv.stdout.String()); m != nil {
			return m[1]
		}
		select {
		case code := <-inv.done:
			t.Fatalf("onceflow ui exited %d:\n%s%s", code, inv.stdout.String(), inv.stderr.String())
		case <-time.After(10 * time.Millisecond):
		}
	}
	t.Fatalf("onceflow ui did not say where it listens:\n%s", inv.stdout.String())
	return ""
}

func get(t *testing.T, url string, set func(*http.Request)) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	set(req)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// `onceflow ui` serves loopback without a credential, refuses any other address without one,
// and with one set in the environment requires it; no secret reaches its output or pages.
func TestUICommand(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	env := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema}

	u := startUI(t, env, "--addr", "127.0.0.1:0")
	code, body := get(t, u, func(*http.Request) {})
	if code != http.StatusOK || !strings.Contains(body, "Is anything stuck?") || !strings.Contains(body, "read-only") {
		t.Fatalf("GET overview: %d\n%s", code, body)
	}
	if strings.Contains(body, db.URL) {
		t.Error("the overview shows the connection string")
	}
	// DNS rebinding: another site's name for this address is refused; localhost is served.
	port := u[strings.LastIndex(u, ":")+1 : len(u)-1]
	if code, _ := get(t, u, func(r *http.Request) { r.Host = "rebind.attacker.example:" + port }); code != http.StatusMisdirectedRequest {
		t.Errorf("GET for another site's host: %d, want 421", code)
	}
	if code, _ := get(t, u, func(r *http.Request) { r.Host = "localhost:" + port }); code != http.StatusOK {
		t.Errorf("GET for localhost: %d, want 200", code)
	}
	// Behind a reverse proxy: the name it passes on is served once given with --host.
	u = startUI(t, env, "--addr", "127.0.0.1:0", "--host", "ops.example.com")
	if code, _ := get(t, u, func(r *http.Request) { r.Host = "ops.example.com" }); code != http.StatusOK {
		t.Errorf("GET for a --host name: %d, want 200", code)
	}
	if code, _ := get(t, u, func(r *http.Request) { r.Host = "other.example.com" }); code != http.StatusMisdirectedRequest {
		t.Errorf("GET for a name not given: %d, want 421", code)
	}
	runCmd(context.Background(), env, "ui", "--addr", "127.0.0.1:0", "--host", "http://ops.example.com/").expect(t, "ui with a URL as --host", 1)

	r := runCmd(context.Background(), env, "ui", "--addr", "0.0.0.0:0").expect(t, "ui on every interface without a credential", 1)
	if !strings.Contains(r.stderr, "ONCEFLOW_UI_TOKEN") || !strings.Contains(r.stderr, "127.0.0.1") {
		t.Errorf("the refusal does not say what to do:\n%s", r.stderr)
	}
	runCmd(context.Background(), env, "ui", "--addr", ":0").expect(t, "ui on :0 without a credential", 1)
	runCmd(context.Background(), env, "ui", "--addr", "nonsense").expect(t, "ui with a bad address", 1)

	withCreds := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema, "ONCEFLOW_UI_USER": "ops", "ONCEFLOW_UI_PASSWORD": "pw-s3cret"}
	u = startUI(t, withCreds, "--addr", "127.0.0.1:0", "--actions")
	if code, _ := get(t, u, func(*http.Request) {}); code != http.StatusUnauthorized {
		t.Errorf("GET without the credential: %d, want 401", code)
	}
	if code, body := get(t, u, func(r *http.Request) { r.SetBasicAuth("ops", "pw-s3cret") }); code != http.StatusOK || !strings.Contains(body, "actions on") {
		t.Errorf("GET with the credential: %d\n%s", code, body)
	}
	// Viewers read, and --actions beyond loopback needs an operator.
	viewers := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema, "ONCEFLOW_UI_VIEWER_TOKEN": "view-t0ken-1"}
	r = runCmd(context.Background(), viewers, "ui", "--addr", "0.0.0.0:0", "--actions").expect(t, "--actions with a viewer's credential only", 1)
	if !strings.Contains(r.stderr, "needs an operator's credential") || strings.Contains(r.stderr, "view-t0ken-1") {
		t.Errorf("the refusal:\n%s", r.stderr)
	}
	both := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema, "ONCEFLOW_UI_TOKEN": "op-t0ken-1", "ONCEFLOW_UI_VIEWER_TOKEN": "view-t0ken-1"}
	u = startUI(t, both, "--addr", "127.0.0.1:0", "--actions")
	if code, body := get(t, u, func(r *http.Request) { r.Header.Set("Authorization", "Bearer view-t0ken-1") }); code != http.StatusOK || !strings.Contains(body, "read-only") {
		t.Errorf("GET as a viewer: %d\n%s", code, body)
	}
	if code, body := get(t, u, func(r *http.Request) { r.Header.Set("Authorization", "Bearer op-t0ken-1") }); code != http.StatusOK || !strings.Contains(body, "actions on") {
		t.Errorf("GET as an operator: %d\n%s", code, body)
	}
}

// Saga timers and operator requests that no orchestrator fires are a stuck condition, with
// the fix; within --max-timer-lag they are not.
func TestStatusOverdueTimers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	env := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema}
	for _, sql := range []string{
		`INSERT INTO ` + db.Table("saga") + ` (id, name, version, state, data, steps) VALUES ('s-1', 'checkout', 1, 'running', '{}', '[]')`,
		`INSERT INTO ` + db.Table("saga_timer") + ` (saga_id, kind, action, due_at) VALUES ('s-1', 'operator', 'compensate', now() - interval '45 minutes')`,
	} {
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	r := runCmd(ctx, env, "status").expect(t, "status with an overdue operator request", exitStuck)
	for _, want := range []string{"1 saga timers and operator requests are overdue", "operator compensate of saga s-1 (checkout), for 45m", "saga.Orchestrator.Run"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("status lacks %q:\n%s", want, r.stdout)
		}
	}
	runCmd(ctx, env, "status", "--max-timer-lag", "1h").expect(t, "status with a longer timer lag", 0)
}

// A password in --database-url is warned about: it shows in ps for the command's life.
func TestDatabaseURLPasswordWarning(t *testing.T) {
	t.Parallel()
	r := runCmd(context.Background(), nil, "status", "--database-url", "postgres://u:hunter22@127.0.0.1:1/db", "--schema", "bad schema")
	if !strings.Contains(r.stderr, "--database-url carries a password") || strings.Contains(r.stderr, "hunter22") {
		t.Errorf("stderr:\n%s", r.stderr)
	}
	r = runCmd(context.Background(), nil, "status", "--database-url", "postgres://u@127.0.0.1:1/db", "--schema", "bad schema")
	if strings.Contains(r.stderr, "carries a password") {
		t.Errorf("a URL without a password was warned about:\n%s", r.stderr)
	}
}
