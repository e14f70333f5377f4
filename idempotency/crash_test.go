package idempotency_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
)

// The crash tests run this test binary again as a child HTTP server (TestMain sees childEnv)
// and SIGKILL it at the moment that matters, then retry against a fresh server.
const (
	childEnv       = "IDEMPOTENCY_TEST_CHILD" // mode: "in-flight" or "after-commit"
	childURLEnv    = "IDEMPOTENCY_TEST_URL"
	childSchemaEnv = "IDEMPOTENCY_TEST_SCHEMA"
)

// runChild serves the order handler behind the middleware and dies by SIGKILL:
//   - in-flight: inside the handler, after its business insert, before anything commits;
//   - after-commit: when the middleware, having committed, starts writing the response.
func runChild(mode string) {
	fail := func(err error) { fmt.Fprintln(os.Stderr, "child:", err); os.Exit(3) }
	cfg, err := pgxpool.ParseConfig(os.Getenv(childURLEnv))
	if err != nil {
		fail(err)
	}
	schema := os.Getenv(childSchemaEnv)
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		fail(err)
	}
	mw, err := idempotency.New(idempotency.Config{Pool: pool, Schema: schema, Owner: ownerFromHeader})
	if err != nil {
		fail(err)
	}
	var runs atomic.Int64
	var app http.Handler
	switch mode {
	case "in-flight":
		app = mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if _, err := outbox.MustTx(r.Context()).Exec(r.Context(), `INSERT INTO orders (owner, item) VALUES ('alice', 'lost')`); err != nil {
				fail(err)
			}
			fmt.Println("IN_HANDLER")
			select {} // until SIGKILL
		}))
	case "after-commit":
		inner := mw.Handler(orderHandler(pgsql.Table(schema, "orders"), &runs))
		app = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			inner.ServeHTTP(killOnWrite{w}, r)
		})
	default:
		fail(fmt.Errorf("unknown mode %q", mode))
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fail(err)
	}
	fmt.Println("LISTEN", ln.Addr())
	fail(http.Serve(ln, app))
}

// killOnWrite SIGKILLs its own process when the response starts: the middleware only gets
// there after the commit, so this is a crash between commit and response.
type killOnWrite struct{ http.ResponseWriter }

func (killOnWrite) WriteHeader(int) {
	syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {}
}
func (k killOnWrite) Write([]byte) (int, error) { k.WriteHeader(0); return 0, nil }

type child struct {
	cmd   *exec.Cmd
	lines *bufio.Scanner
	addr  string
}

func startChild(t *testing.T, db *testdb.DB, mode string) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+mode, childURLEnv+"="+db.URL, childSchemaEnv+"="+db.Schema)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	c := &child{cmd: cmd, lines: bufio.NewScanner(out)}
	line := c.next(t)
	addr, ok := strings.CutPrefix(line, "LISTEN ")
	if !ok {
		t.Fatalf("child said %q; want LISTEN <addr>", line)
	}
	c.addr = addr
	return c
}

func (c *child) next(t *testing.T) string {
	t.Helper()
	if !c.lines.Scan() {
		t.Fatalf("child exited early: %v", c.lines.Err())
	}
	return c.lines.Text()
}

// waitKilled waits for the child and checks SIGKILL ended it.
func (c *child) waitKilled(t *testing.T) {
	t.Helper()
	err := c.cmd.Wait()
	var exit *exec.ExitError
	if !errors.As(err, &exit) {
		t.Fatalf("child exit: %v; want killed by SIGKILL", err)
	}
	if ws, ok := exit.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("child exit: %v; want killed by SIGKILL", err)
	}
}

func postOrder(addr, user, key, body string) (*http.Response, error) {
	req, err := http.NewRequest("POST", "http://"+addr+"/orders", strings.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("X-User", user)
	req.Header.Set(idempotency.HeaderKey, key)
	client := &http.Client{Timeout: 2 * time.Minute}
	return client.Do(req)
}

// restartedServer is the "server after the restart": a fresh process-local middleware on the
// same schema. WaitInFlight covers the moment PostgreSQL takes to notice the dead connection.
func restartedServer(t *testing.T, db *testdb.DB, runs *atomic.Int64) *fixture {
	t.Helper()
	mw, err := idempotency.New(idempotency.Config{Pool: db.Pool, Schema: db.Schema, Owner: ownerFromHeader, WaitInFlight: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw.Handler(orderHandler(db.Table("orders"), runs)))
	t.Cleanup(srv.Close)
	return &fixture{db: db, mw: mw, srv: srv}
}

func TestCrashInFlightLeavesNoLockAndNoWrites(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	createOrders(t, db)
	c := startChild(t, db, "in-flight")
	errc := make(chan error, 1)
	go func() {
		res, err := postOrder(c.addr, "alice", `"k"`, "book")
		if err == nil {
			res.Body.Close()
			err = fmt.Errorf("got a response %d from a killed server", res.StatusCode)
		} else {
			err = nil
		}
		errc <- err
	}()
	if line := c.next(t); line != "IN_HANDLER" {
		t.Fatalf("child said %q", line)
	}
	if err := c.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	c.waitKilled(t)
	if err := <-errc; err != nil {
		t.Fatal(err)
	}

	var runs atomic.Int64
	f := restartedServer(t, db, &runs)
	r := f.send(t, "POST", "/orders", "alice", `"k"`, "book")
	if r.status != http.StatusCreated || r.replayed() {
		t.Fatalf("retry after the crash: %d replayed=%v %s; want a fresh 201", r.status, r.replayed(), r.body)
	}
	if runs.Load() != 1 || f.orders(t) != 1 || f.count(t, `SELECT count(*) FROM `+f.db.Table("orders")+` WHERE item = 'lost'`) != 0 {
		t.Fatalf("runs=%d orders=%d; the killed request's write must be gone and the retry's kept", runs.Load(), f.orders(t))
	}
}

func TestCrashAfterCommitRetryReplays(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	createOrders(t, db)
	c := startChild(t, db, "after-commit")
	res, err := postOrder(c.addr, "alice", `"k"`, "book")
	if err == nil {
		res.Body.Close()
		t.Fatalf("got a response %d from a server killed before responding", res.StatusCode)
	}
	c.waitKilled(t)

	var runs atomic.Int64
	f := restartedServer(t, db, &runs)
	r := f.send(t, "POST", "/orders", "alice", `"k"`, "book")
	if r.status != http.StatusCreated || !r.replayed() {
		t.Fatalf("retry after the crash: %d replayed=%v %s; want the stored 201", r.status, r.replayed(), r.body)
	}
	var id int64
	if err := db.Pool.QueryRow(context.Background(), `SELECT id FROM `+db.Table("orders")).Scan(&id); err != nil {
		t.Fatal(err)
	}
	if runs.Load() != 0 || f.orders(t) != 1 || !strings.Contains(string(r.body), fmt.Sprintf(`"id":%d`, id)) || r.header.Get("Location") != fmt.Sprintf("/orders/%d", id) {
		t.Fatalf("runs=%d orders=%d body=%s; want the crashed server's order %d replayed", runs.Load(), f.orders(t), r.body, id)
	}
}
