// Package failure is the one place where onceflow's consumers decide whose a failure is, and
// how long to wait before the next try. Every consumer (the inbox, the batched consumer, the
// saga orchestrator and participants) asks the same questions:
//
//   - Transient: did the work fail for a reason of the moment — the database unreachable or
//     restarting, the connection lost, a deadlock, a serialization failure, a lock or
//     statement timeout, the server short of resources? Then the failure belongs to the batch
//     (or the single message's transaction), never to a message: it is tried again without
//     counting an attempt, never given up as poison and never answered as a saga step's
//     failure.
//   - Contention: is it a conflict between concurrent transactions (deadlock, serialization
//     failure, lock timeout)? Then it is worth retrying at once, and with fewer messages per
//     transaction if it repeats, rather than waiting out a backoff.
//
// Anything else a handler returns is the message's: a constraint violation, a misuse of the
// connection (`conn busy`: rows left open; `conn closed`), a bug. It counts as an attempt,
// and after its attempts the message is given up.
package failure

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Transient reports whether err failed for a reason of the moment rather than of the message
// (see the package documentation): running the same work again, unchanged, may succeed.
//
//   - SQLSTATE class 40 (serialization failure, deadlock, statement completion unknown),
//     except 40002 (an integrity constraint violated at commit: the data's fault);
//   - class 08 (connection exceptions) and class 53 (insufficient resources: disk full, out
//     of memory, too many connections);
//   - 55P03 (lock_not_available: lock_timeout) and 57014 (query_canceled: statement_timeout);
//   - 57P01–57P03 (the server shutting down, crashed, or starting up);
//   - a connection that could not be made (*pgconn.ConnectError) or was lost mid-statement
//     (a network error, an unexpected EOF).
//
// pgx's own `conn busy` and `conn closed` are not transient by themselves: a handler that left
// a query's rows open, or used a connection it had closed, fails the same way every time. A
// lost connection also shows up as `conn closed`; OfBatch tells the two apart.
func Transient(err error) bool {
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		c := pgErr.Code
		switch {
		case c == "40002":
			return false
		case strings.HasPrefix(c, "40"), strings.HasPrefix(c, "08"), strings.HasPrefix(c, "53"):
			return true
		}
		switch c {
		case "55P03", "57014", "57P01", "57P02", "57P03":
			return true
		}
		return false
	}
	if errors.Is(err, pgconn.ErrConnClosed) {
		return false // pgx refused a statement on a closed connection: see above
	}
	var connErr *pgconn.ConnectError
	if errors.As(err, &connErr) {
		return true
	}
	var netErr net.Error
	return errors.As(err, &netErr) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EPIPE)
}

// OfBatch is the rule every consumer applies to the error of work done on conn (a handler's
// error, or the commit's): true when the failure is the batch's — Transient(err), or conn is
// gone. pgx reports a connection lost mid-statement as `conn closed` on the statement in flight
// (and on every later one), which is also what a handler's misuse of another, closed
// connection returns: whether the transaction's own connection is closed tells the two apart.
// False for a nil err.
func OfBatch(err error, conn *pgx.Conn) bool {
	if err == nil {
		return false
	}
	return Transient(err) || (conn != nil && conn.IsClosed())
}

// Contention reports whether err is a conflict with a concurrent transaction: a deadlock
// (40P01), a serialization failure (40001) or a lock timeout (55P03). Such a batch is retried
// at once, and smaller if it repeats: the rows it touched are hot, and fewer messages per
// transaction hold fewer locks for less time.
func Contention(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch pgErr.Code {
	case "40P01", "40001", "55P03":
		return true
	}
	return false
}

// Backoff is the wait before retry n (n ≥ 1): base, doubled per retry, capped at limit.
func Backoff(base, limit time.Duration, n int) time.Duration {
	d := base
	for i := 1; i < n && d < limit; i++ {
		d *= 2
	}
	return min(d, limit)
}

// Sleep waits for d or until ctx ends, and reports whether it waited the whole time.
func Sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
