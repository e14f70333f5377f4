package testutil

import (
	"bufio"
	"io"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"
)

// Child is a copy of the test binary running as a child process (a consumer a test can
// SIGKILL): its TestMain sees an environment variable the test sets and runs the child's code
// instead of the tests.
type Child struct {
	Cmd    *exec.Cmd
	Stderr *SyncBuffer
	// Exited is closed once the process exited and every line of its stdout was handled.
	Exited chan struct{}
}

// StartChild runs the test binary with env added to the environment, calling onLine (on one
// goroutine) for each line the child prints on stdout. The child is killed, if still running,
// when the test ends.
func StartChild(t testing.TB, env []string, onLine func(line string)) *Child {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), env...)
	// An io.Pipe rather than StdoutPipe: Wait then finishes copying before it returns, so no
	// line printed just before a SIGKILL is lost.
	stdout, pw := io.Pipe()
	cmd.Stdout = pw
	c := &Child{Cmd: cmd, Stderr: &SyncBuffer{}, Exited: make(chan struct{})}
	cmd.Stderr = c.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	read := make(chan struct{})
	go func() {
		defer close(read)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			onLine(sc.Text())
		}
		_, _ = io.Copy(io.Discard, stdout)
	}()
	go func() { _ = cmd.Wait(); _ = pw.Close(); <-read; close(c.Exited) }()
	t.Cleanup(func() {
		select {
		case <-c.Exited:
		default:
			_ = cmd.Process.Kill() // only the process this test started
			<-c.Exited
		}
	})
	return c
}

// WaitExit waits for the child to exit, failing the test after limit.
func (c *Child) WaitExit(t testing.TB, limit time.Duration) {
	t.Helper()
	select {
	case <-c.Exited:
	case <-time.After(limit):
		t.Fatalf("child did not exit within %s; stderr:\n%s", limit, c.Stderr.String())
	}
}

// KilledBySIGKILL reports whether the exited child died of SIGKILL.
func (c *Child) KilledBySIGKILL() bool {
	ws, ok := c.Cmd.ProcessState.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}
