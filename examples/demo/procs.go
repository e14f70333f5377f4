package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// proc is a child process the demo starts, kills and restarts: a service or a relay.
type proc struct {
	name string
	bin  string
	args []string
	env  []string
	addr string // services: the HTTP address, for /healthz and /debug/counters

	mu       sync.Mutex
	cmd      *exec.Cmd
	exited   chan struct{}
	stopping bool
	kills    int
	restarts int
}

func (p *proc) start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	cmd := exec.Command(p.bin, p.args...)
	cmd.Env = append(os.Environ(), p.env...)
	cmd.Stdout = io.Discard
	cmd.Stderr = prefixWriter{prefix: fmt.Sprintf("  [%s] ", p.name), w: os.Stderr}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", p.name, err)
	}
	if p.cmd != nil {
		p.restarts++
	}
	p.cmd, p.exited = cmd, make(chan struct{})
	exited := p.exited
	go func() { _ = cmd.Wait(); close(exited) }()
	return nil
}

// failed reports whether the process exited without being told to.
func (p *proc) failed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopping || p.cmd == nil {
		return false
	}
	select {
	case <-p.exited:
		return true
	default:
		return false
	}
}

func (p *proc) pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd.Process.Pid
}

// kill sends SIGKILL, as a crash or an OOM kill would, and waits for the process to die.
func (p *proc) kill() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stopping = true
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.exited
	p.kills++
	p.stopping = false
}

// stop ends the process gracefully (SIGTERM), as an orchestrator would, and reports whether it
// exited cleanly within the grace period.
func (p *proc) stop() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return nil
	}
	p.stopping = true
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(15 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.exited
		return fmt.Errorf("%s did not stop within 15s of SIGTERM; killed", p.name)
	}
	if code := p.cmd.ProcessState.ExitCode(); code != 0 {
		return fmt.Errorf("%s exited with status %d after SIGTERM", p.name, code)
	}
	return nil
}

// waitHealthy polls GET /healthz until it answers 200.
func (p *proc) waitHealthy(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		resp, err := httpc.Get("http://" + p.addr + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if p.failed() {
			return fmt.Errorf("%s exited during start-up; see its log lines above", p.name)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not healthy after %s", p.name, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// prefixWriter prefixes every line a child writes, so the demo's output says who spoke.
type prefixWriter struct {
	prefix string
	w      io.Writer
}

func (w prefixWriter) Write(b []byte) (int, error) {
	for _, line := range strings.SplitAfter(string(b), "\n") {
		if line != "" {
			fmt.Fprint(w.w, w.prefix+line)
		}
	}
	return len(b), nil
}
