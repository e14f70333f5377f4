package relay_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/internal/testutil"
)

// buildOnceflow builds the onceflow command into a temporary folder and returns its path.
func buildOnceflow(t testing.TB) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	root := filepath.Dir(filepath.Dir(file))
	bin := filepath.Join(t.TempDir(), "onceflow")
	args := []string{"build", "-o", bin}
	if raceEnabled {
		args = append(args, "-race")
	}
	args = append(args, "./cmd/onceflow")
	cmd := exec.Command("go", args...)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/onceflow: %v\n%s", err, out)
	}
	return bin
}

// child is one `onceflow relay` process.
type child struct {
	cmd  *exec.Cmd
	out  *testutil.SyncBuffer
	done chan struct{}
	err  error
}

// startChild runs `onceflow relay` against the test's schema and brokers with extra flags.
func startChild(t testing.TB, bin string, db *testdb.DB, brokers []string, extra ...string) *child {
	t.Helper()
	args := append([]string{"relay", "--database-url", db.URL, "--schema", db.Schema,
		"--kafka-brokers", strings.Join(brokers, ","), "--log-level", "debug"}, extra...)
	c := &child{cmd: exec.Command(bin, args...), out: &testutil.SyncBuffer{}, done: make(chan struct{})}
	c.cmd.Stdout, c.cmd.Stderr = c.out, c.out
	c.cmd.Env = append(os.Environ(), "GORACE=halt_on_error=1")
	if err := c.cmd.Start(); err != nil {
		t.Fatalf("start onceflow relay: %v", err)
	}
	go func() { c.err = c.cmd.Wait(); close(c.done) }()
	t.Cleanup(func() {
		c.kill()
		if t.Failed() {
			t.Logf("output of relay pid %d:\n%s", c.cmd.Process.Pid, tail(c.out.String(), 60))
		}
	})
	return c
}

// kill sends SIGKILL and waits for the process to be gone.
func (c *child) kill() {
	_ = c.cmd.Process.Signal(syscall.SIGKILL)
	<-c.done
}

// stop sends SIGTERM and returns the exit error (nil for exit 0).
func (c *child) stop(timeout time.Duration) error {
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
		return c.err
	case <-time.After(timeout):
		c.kill()
		return fmt.Errorf("relay did not exit within %s of SIGTERM", timeout)
	}
}

// exited reports whether the process ended on its own, and how.
func (c *child) exited() (bool, error) {
	select {
	case <-c.done:
		return true, c.err
	default:
		return false, nil
	}
}

func tail(s string, lines int) string {
	ls := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(ls) > lines {
		ls = ls[len(ls)-lines:]
	}
	return strings.Join(ls, "\n")
}
