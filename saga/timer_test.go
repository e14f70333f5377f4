package saga_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/saga"
)

// childEnv makes this test binary run an orchestrator (Run: timers only) for the kill test.
const childEnv = "ONCEFLOW_SAGA_TEST_CHILD"

func init() {
	if os.Getenv(childEnv) != "" {
		os.Exit(childMain())
	}
}

// timeoutDef: step reserve times out after timeout, 2 attempts; nobody consumes its commands.
func timeoutDef(t testing.TB, timeout time.Duration) *saga.Definition[Checkout] {
	return checkoutDef(t, func(name string, s *saga.StepDef[Checkout]) {
		if name == "reserve" {
			s.Attempts(2, time.Millisecond).Timeout(timeout)
		}
	})
}

func childMain() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "child:", err); return 1 }
	pool, err := pgxpool.New(ctx, os.Getenv("CHILD_DB_URL"))
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	timeout, err := time.ParseDuration(os.Getenv("CHILD_TIMEOUT"))
	if err != nil {
		return fail(err)
	}
	o, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: pool, Schema: os.Getenv("CHILD_SCHEMA"), TimerInterval: 20 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, nil))})
	if err != nil {
		return fail(err)
	}
	if err := saga.Register(o, timeoutDef(nil, timeout)); err != nil {
		return fail(err)
	}
	fmt.Println("READY")
	if err := o.Run(ctx); err != nil {
		return fail(err)
	}
	return 0
}

// attemptsSent counts the commands of step reserve per attempt in the outbox.
func (w *world) attemptsSent(id string) map[string]int {
	w.t.Helper()
	rows, err := w.db.Pool.Query(context.Background(), `SELECT metadata->>'saga_attempt', count(*) FROM `+w.db.Schema+
		`.outbox WHERE topic = 'cmd.reserve' AND metadata->>'saga_id' = $1 GROUP BY 1`, id)
	if err != nil {
		w.t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var a string
		var n int
		if err := rows.Scan(&a, &n); err != nil {
			w.t.Fatal(err)
		}
		out[a] = n
	}
	return out
}

// A step's timeout is due while the orchestrator process is SIGKILLed; after the restart it
// fires exactly once: one attempt-2 command, not two.
func TestTimeoutSurvivesOrchestratorKill(t *testing.T) {
	t.Parallel()
	const timeout = 700 * time.Millisecond
	w := newWorld(t, timeoutDef(t, timeout), "reserve")
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	start := func() *exec.Cmd {
		cmd := exec.Command(exe, "-test.run=^$")
		cmd.Env = append(os.Environ(), childEnv+"=1", "CHILD_DB_URL="+w.db.URL, "CHILD_SCHEMA="+w.db.Schema, "CHILD_TIMEOUT="+timeout.String())
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		line, err := bufio.NewReader(out).ReadString('\n')
		if err != nil || strings.TrimSpace(line) != "READY" {
			t.Fatalf("child did not start: %q %v", line, err)
		}
		go func() { _, _ = io.Copy(io.Discard, out) }()
		return cmd
	}
	child := start()
	id := w.start("o-kill")
	// SIGKILL before the timeout is due, and stay down past it.
	if err := child.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = child.Wait()
	time.Sleep(timeout + 300*time.Millisecond)
	if got := w.attemptsSent(id); got["2"] != 0 {
		t.Fatalf("attempt 2 sent while no orchestrator ran: %v", got)
	}
	start()
	deadline := time.Now().Add(30 * time.Second)
	for w.attemptsSent(id)["2"] == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the timeout did not fire after the restart")
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond) // a second firing would show up by now (interval 20ms)
	if got := w.attemptsSent(id); got["1"] != 1 || got["2"] != 1 {
		t.Fatalf("commands per attempt %v, want one each", got)
	}
}

// Two orchestrators fire the timers of many sagas at once: each timer fires exactly once.
func TestTimersFireOnceWithTwoOrchestrators(t *testing.T) {
	t.Parallel()
	const n = 40
	w := newWorld(t, timeoutDef(t, 300*time.Millisecond), "reserve")
	ids := make([]string, n)
	for i := range ids {
		ids[i] = w.start(fmt.Sprintf("o-%d", i))
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for range 2 {
		o := w.newOrchestrator()
		wg.Add(1)
		go func() { defer wg.Done(); _ = o.Run(ctx) }()
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		done := 0
		for _, id := range ids {
			if w.get(id).Steps[0].Attempts == 2 {
				done++
			}
		}
		if done == n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d sagas re-sent their command", done, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	wg.Wait()
	for _, id := range ids {
		if got := w.attemptsSent(id); got["1"] != 1 || got["2"] != 1 {
			t.Fatalf("saga %s: commands per attempt %v, want one each", id, got)
		}
	}
}
