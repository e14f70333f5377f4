// Package redistest starts a real redis-server for a test: the binary from PATH (the Debian
// package redis-server; .ci/run installs it), on a free port, with its files in a temporary
// folder and persistence off. It is stopped when the test ends.
package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/embedded"
	"github.com/onceflow/onceflow/internal/testutil"
)

// Server is a running redis-server.
type Server struct {
	addr   string
	cmd    *exec.Cmd
	exited chan struct{}
	output *testutil.SyncBuffer
}

// Addr is the server's host:port.
func (s *Server) Addr() string { return s.addr }

// Client returns a new client of the server, closed when the test ends.
func (s *Server) Client(t testing.TB) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: s.addr, MaxRetries: -1})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// Stop kills the server and waits for it to exit. It is safe to call more than once; tests
// call it to see how code behaves when Redis is gone.
func (s *Server) Stop() {
	select {
	case <-s.exited:
		return
	default:
	}
	_ = s.cmd.Process.Kill() // the process this package started, by its pid
	<-s.exited
}

// Start runs a redis-server for the test and waits until it answers PING.
func Start(t testing.TB) *Server {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Fatalf("redistest: redis-server is not on PATH; install it (apt-get install -y redis-server): %v", err)
	}
	var lastErr error
	// A free port can be taken between choosing and binding it; try a few.
	for range 3 {
		s, err := start(t, bin)
		if err == nil {
			t.Cleanup(s.Stop)
			return s
		}
		lastErr = err
	}
	t.Fatalf("redistest: %v", lastErr)
	return nil
}

func start(t testing.TB, bin string) (*Server, error) {
	port, err := embedded.FreePort()
	if err != nil {
		return nil, err
	}
	dir := t.TempDir()
	cmd := exec.Command(bin,
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", dir,
		"--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning")
	out := &testutil.SyncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start redis-server: %w", err)
	}
	s := &Server{addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), cmd: cmd, exited: make(chan struct{}), output: out}
	go func() { _ = cmd.Wait(); close(s.exited) }()

	c := redis.NewClient(&redis.Options{Addr: s.addr, MaxRetries: -1, DialTimeout: time.Second})
	defer func() { _ = c.Close() }() // a probe client; its close error says nothing about the server
	deadline := time.Now().Add(30 * time.Second)
	for {
		select {
		case <-s.exited:
			return nil, fmt.Errorf("redis-server exited at start-up:\n%s", out.String())
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return s, nil
		}
		if time.Now().After(deadline) {
			s.Stop()
			return nil, errors.Join(fmt.Errorf("redis-server on %s did not answer PING within 30s", s.addr), err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
