package failure_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/internal/failure"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// TestClassification runs each failure for real (against PostgreSQL, pgx, an HTTP client, a
// JSON decoder), then checks the one rule every consumer applies: a failure of the
// transaction's own connection or server is the transaction's (retried, no attempt counted),
// everything else the message's — also the errors that only look like network errors.
func TestClassification(t *testing.T) {
	db := testdb.New(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tbl := db.Table("hot")
	mustExec(t, db.Pool, `CREATE TABLE `+tbl+` (id int PRIMARY KEY, n int NOT NULL)`)
	mustExec(t, db.Pool, `INSERT INTO `+tbl+` VALUES (1, 0), (2, 0)`)
	deferred := db.Table("deferred")
	mustExec(t, db.Pool, `CREATE TABLE `+deferred+` (id int, CONSTRAINT deferred_once UNIQUE (id) DEFERRABLE INITIALLY DEFERRED)`)

	connect := func(t *testing.T) *pgx.Conn {
		c, err := pgx.Connect(ctx, db.URL)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close(context.Background()) })
		return c
	}

	cases := []struct {
		name string
		// make causes the failure and returns the connection it happened on and its error
		// (nil when none or not the transaction's own).
		make       func(t *testing.T) (*pgx.Conn, error)
		batch      bool // the transaction's failure (Whose: Transaction), not the message's
		contention bool
	}{
		{"deadlock (40P01)", func(t *testing.T) (*pgx.Conn, error) { return nil, deadlock(t, ctx, connect(t), connect(t), tbl) }, true, true},
		{"serialization failure (40001)", func(t *testing.T) (*pgx.Conn, error) {
			a, b := connect(t), connect(t)
			ta, err := a.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = ta.Rollback(ctx) }()
			if _, err := ta.Exec(ctx, `SELECT n FROM `+tbl+` WHERE id = 1`); err != nil {
				t.Fatal(err)
			}
			if _, err := b.Exec(ctx, `UPDATE `+tbl+` SET n = n + 1 WHERE id = 1`); err != nil {
				t.Fatal(err)
			}
			_, err = ta.Exec(ctx, `UPDATE `+tbl+` SET n = n + 1 WHERE id = 1`)
			return nil, err
		}, true, true},
		{"lock timeout (55P03)", func(t *testing.T) (*pgx.Conn, error) {
			a, b := connect(t), connect(t)
			ta, err := a.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = ta.Rollback(ctx) }()
			if _, err := ta.Exec(ctx, `UPDATE `+tbl+` SET n = n + 1 WHERE id = 2`); err != nil {
				t.Fatal(err)
			}
			if _, err := b.Exec(ctx, `SET lock_timeout = '50ms'`); err != nil {
				t.Fatal(err)
			}
			_, err = b.Exec(ctx, `UPDATE `+tbl+` SET n = n + 1 WHERE id = 2`)
			return nil, err
		}, true, true},
		{"statement timeout (57014)", func(t *testing.T) (*pgx.Conn, error) {
			c := connect(t)
			if _, err := c.Exec(ctx, `SET statement_timeout = '50ms'`); err != nil {
				t.Fatal(err)
			}
			_, err := c.Exec(ctx, `SELECT pg_sleep(5)`)
			return nil, err
		}, true, false},
		{"backend terminated (57P01)", func(t *testing.T) (*pgx.Conn, error) {
			a, b := connect(t), connect(t)
			pid := a.PgConn().PID()
			errc := make(chan error, 1)
			go func() { _, err := a.Exec(ctx, `SELECT pg_sleep(10)`); errc <- err }()
			waitActive(t, ctx, b, int64(pid))
			if _, err := b.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
				t.Fatal(err)
			}
			return a, <-errc
		}, true, false},
		{"connection lost mid-statement", func(t *testing.T) (*pgx.Conn, error) {
			p := testdb.NewProxy(t, db)
			pc, err := p.Pool(t, db, 1).Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer pc.Release()
			c := pc.Conn()
			errc := make(chan error, 1)
			go func() { _, err := c.Exec(ctx, `SELECT pg_sleep(10)`); errc <- err }()
			waitActive(t, ctx, connect(t), int64(c.PgConn().PID()))
			p.Cut()
			return c, <-errc
		}, true, false},
		{"connection refused", func(t *testing.T) (*pgx.Conn, error) {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			port := l.Addr().(*net.TCPAddr).Port
			_ = l.Close()
			_, err = pgx.Connect(ctx, fmt.Sprintf("postgres://x@127.0.0.1:%d/x?connect_timeout=2", port))
			return nil, err
		}, true, false},
		// A server in recovery or out of connection slots answers like this; neither state can
		// be produced on demand here, so these two are built as pgconn reports them.
		{"server starting up (57P03)", func(*testing.T) (*pgx.Conn, error) {
			return nil, &pgconn.PgError{Severity: "FATAL", Code: "57P03", Message: "the database system is starting up"}
		}, true, false},
		{"too many connections (53300)", func(*testing.T) (*pgx.Conn, error) {
			return nil, &pgconn.PgError{Severity: "FATAL", Code: "53300", Message: "sorry, too many clients already"}
		}, true, false},
		{"conn busy: a handler left rows open", func(t *testing.T) (*pgx.Conn, error) {
			c := connect(t)
			rows, err := c.Query(ctx, `SELECT generate_series(1, 1000)`)
			if err != nil {
				t.Fatal(err)
			}
			defer rows.Close()
			_, err = c.Exec(ctx, `SELECT 1`)
			return c, err
		}, false, false},
		{"conn closed: a handler used a closed connection", func(t *testing.T) (*pgx.Conn, error) {
			c := connect(t)
			_ = c.Close(ctx)
			_, err := c.Exec(ctx, `SELECT 1`)
			return nil, err
		}, false, false},
		{"unique violation (23505)", func(t *testing.T) (*pgx.Conn, error) {
			_, err := db.Pool.Exec(ctx, `INSERT INTO `+tbl+` VALUES (1, 0)`)
			return nil, err
		}, false, false},
		{"deferred constraint violated at COMMIT", func(t *testing.T) (*pgx.Conn, error) {
			tx, err := db.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(ctx, `INSERT INTO `+deferred+` VALUES (7), (7)`); err != nil {
				t.Fatal(err)
			}
			return tx.Conn(), tx.Commit(ctx)
		}, false, false},
		{"syntax error", func(t *testing.T) (*pgx.Conn, error) {
			_, err := db.Pool.Exec(ctx, `SELEC 1`)
			return nil, err
		}, false, false},
		{"aborted transaction the handler carried on in", func(*testing.T) (*pgx.Conn, error) { return nil, pgsql.ErrTxAborted }, false, false},
		{"a handler's own error", func(*testing.T) (*pgx.Conn, error) { return nil, errors.New("card declined") }, false, false},
		// Errors that look like network errors but are not the transaction's: the message's.
		{"an HTTP client's refused connection (*url.Error, a net.Error)", func(t *testing.T) (*pgx.Conn, error) {
			_, err := http.Get("http://" + refusedAddr(t) + "/charge")
			return connect(t), err
		}, false, false},
		{"an HTTP client's timeout", func(t *testing.T) (*pgx.Conn, error) {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close() // accepts nothing: the request times out
			_, err = (&http.Client{Timeout: 50 * time.Millisecond}).Get("http://" + l.Addr().String())
			return connect(t), err
		}, false, false},
		{"a decoder's EOF on an empty payload", func(t *testing.T) (*pgx.Conn, error) {
			var v map[string]any
			return connect(t), json.NewDecoder(bytes.NewReader(nil)).Decode(&v)
		}, false, false},
		{"a truncated payload (io.ErrUnexpectedEOF)", func(t *testing.T) (*pgx.Conn, error) {
			var v struct{ A, B int }
			return connect(t), binary.Read(bytes.NewReader([]byte{1, 2, 3}), binary.BigEndian, &v)
		}, false, false},
		{"a reset from another server (ECONNRESET)", func(t *testing.T) (*pgx.Conn, error) {
			return connect(t), &net.OpError{Op: "read", Net: "tcp", Err: &os.SyscallError{Syscall: "read", Err: syscall.ECONNRESET}}
		}, false, false},
		{"a handler's own deadline (wrapped context.DeadlineExceeded)", func(t *testing.T) (*pgx.Conn, error) {
			return connect(t), fmt.Errorf("call the tax service: %w", context.DeadlineExceeded)
		}, false, false},
		{"a handler's own deadline cut its statement on the transaction's connection", func(t *testing.T) (*pgx.Conn, error) {
			c := connect(t)
			sctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
			defer cancel()
			_, err := c.Exec(sctx, `SELECT pg_sleep(5)`)
			return c, err
		}, false, false},
		{"nil", func(*testing.T) (*pgx.Conn, error) { return nil, nil }, false, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			conn, err := c.make(t)
			if c.name != "nil" && err == nil {
				t.Fatal("the failure did not happen")
			}
			var wrapped error
			if err != nil {
				wrapped = fmt.Errorf("handler: %w", err)
			}
			want := failure.Message
			switch {
			case err == nil:
				want = failure.None
			case c.batch:
				want = failure.Transaction
			}
			if got := failure.Whose(context.Background(), wrapped, conn); got != want {
				t.Errorf("Whose(%v (%T)) = %v, want %v", err, err, got, want)
			}
			if got := failure.Contention(wrapped); got != c.contention {
				t.Errorf("Contention(%v) = %v, want %v", err, got, c.contention)
			}
		})
	}
}

// TestWhoseContext: the consumer's context decides first. Cancelled (a revoked partition, a
// shutdown): nobody's, whatever the handler returned. Past its deadline (Watermill's
// middleware.Timeout): the message's, even when the deadline closed the transaction's
// connection under a statement. The engine's own commit timeout is the transaction's.
func TestWhoseContext(t *testing.T) {
	db := testdb.New(t)
	stopped, stop := context.WithCancel(context.Background())
	stop()
	if got := failure.Whose(stopped, errors.New("card declined"), nil); got != failure.Stopping {
		t.Errorf("a cancelled consumer context: %v, want Stopping", got)
	}
	if got := failure.Whose(stopped, &pgconn.PgError{Code: "40P01"}, nil); got != failure.Stopping {
		t.Errorf("a deadlock while stopping: %v, want Stopping", got)
	}

	c, err := pgx.Connect(context.Background(), db.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	msgCtx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err = c.Exec(msgCtx, `SELECT pg_sleep(5)`)
	if !c.IsClosed() || !pgconn.Timeout(err) {
		t.Fatalf("expected pgx to close the connection with a timeout; got closed=%v, err %v", c.IsClosed(), err)
	}
	if got := failure.Whose(msgCtx, err, c); got != failure.Message {
		t.Errorf("the message's deadline cut its statement: %v, want Message", got)
	}
	// The same error seen by the engine's COMMIT (its own detached timeout): the transaction's.
	if !failure.OfTransaction(err, c) {
		t.Error("OfTransaction of a statement timed out by pgx = false, want true")
	}
}

func refusedAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	return addr
}

func TestBackoff(t *testing.T) {
	for _, c := range []struct {
		n    int
		want time.Duration
	}{{1, 100 * time.Millisecond}, {2, 200 * time.Millisecond}, {3, 400 * time.Millisecond}, {7, time.Second}, {1000, time.Second}, {0, 100 * time.Millisecond}} {
		if got := failure.Backoff(100*time.Millisecond, time.Second, c.n); got != c.want {
			t.Errorf("Backoff(100ms, 1s, %d) = %s, want %s", c.n, got, c.want)
		}
	}
}

func TestSleepEndsWithItsContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if failure.Sleep(ctx, time.Hour) {
		t.Fatal("Sleep on an ended context reported a whole wait")
	}
	if !failure.Sleep(context.Background(), time.Millisecond) {
		t.Fatal("Sleep of 1ms did not complete")
	}
}

func mustExec(t *testing.T, db interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, sql string) {
	t.Helper()
	if _, err := db.Exec(context.Background(), sql); err != nil {
		t.Fatal(err)
	}
}

// deadlock makes two transactions lock two rows in opposite orders and returns the victim's
// error.
func deadlock(t *testing.T, ctx context.Context, a, b *pgx.Conn, tbl string) error {
	ta, err := a.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ta.Rollback(ctx) }()
	tb, err := b.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tb.Rollback(ctx) }()
	if _, err := ta.Exec(ctx, `UPDATE `+tbl+` SET n = n + 1 WHERE id = 1`); err != nil {
		t.Fatal(err)
	}
	if _, err := tb.Exec(ctx, `UPDATE `+tbl+` SET n = n + 1 WHERE id = 2`); err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 2)
	go func() { _, err := ta.Exec(ctx, `UPDATE `+tbl+` SET n = n + 1 WHERE id = 2`); errs <- err }()
	_, errB := tb.Exec(ctx, `UPDATE `+tbl+` SET n = n + 1 WHERE id = 1`)
	if errB != nil {
		_ = tb.Rollback(ctx) // lets a's statement finish
		<-errs
		return errB
	}
	return <-errs
}

// waitActive waits until the backend pid runs pg_sleep.
func waitActive(t *testing.T, ctx context.Context, c *pgx.Conn, pid int64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var n int
		err := c.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep%' AND state = 'active'
			AND pid = $1::bigint`, pid).Scan(&n)
		if err == nil && n > 0 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("the statement did not start within 10s")
}
