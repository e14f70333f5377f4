// Package failure is the one rule onceflow's consumers apply to decide whose a failure is, and
// how long to wait before the next try. Every consumer (the inbox, the batched consumer, the
// saga orchestrator and participants) runs its work through internal/engine, which asks this
// package one question of every error a handler returns: whose is it?
//
//   - The transaction's (OfTransaction): its own connection or server failed — the connection
//     lost, refused or reset, the server restarting, a deadlock, a serialization failure, a
//     lock or statement timeout, the server short of resources. Such a failure belongs to the
//     batch: it is tried again without counting an attempt, never given up as poison and never
//     answered as a saga step's failure.
//   - The message's: everything else a handler returns, including errors that merely look
//     like network errors but come from elsewhere: an HTTP client's (*url.Error is a
//     net.Error), a deadline (context.DeadlineExceeded is a net.Error too), a decoder's io.EOF
//     on an empty payload, a misuse of the connection (`conn busy`: rows left open). It counts
//     an attempt, and after its attempts the message is given up, so one message never blocks
//     its partition forever.
//   - Nobody's: the consumer is stopping (its context was cancelled: a revoked partition, a
//     shutdown). Nothing is counted; the message is delivered again to whoever owns it next.
//
// An error's type is not its origin: only pgconn's own error types, a SQLSTATE and the
// transaction's connection found closed say that the database failed.
package failure

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Verdict says whose a failure is.
type Verdict int

const (
	// None: there was no failure.
	None Verdict = iota
	// Stopping: the consumer's context was cancelled (a revoked partition, a shutdown). Nobody's:
	// no attempt is counted and the message is delivered again.
	Stopping
	// Transaction: the transaction's own connection or server failed (OfTransaction). The
	// batch's: retried without counting an attempt, never given up.
	Transaction
	// Message: the message's. It counts an attempt; after its attempts it is given up.
	Message
)

// Whose says whose err is: the error of a handler that ran in a transaction on conn, under ctx
// (the message's context, or the batch's). In this order:
//
//  1. nil: None;
//  2. ctx was cancelled: Stopping — the consumer stops, whatever the handler returned;
//  3. a deadline or cancellation that is not the consumer's — ctx's deadline passed
//     (Watermill's middleware.Timeout), or the handler returns context.DeadlineExceeded or
//     context.Canceled of a context of its own: Message. pgx closes the connection when a
//     statement's context ends, so this comes before the closed-connection rule: the
//     handler's deadline closed it, not the server;
//  4. OfTransaction(err, conn): Transaction;
//  5. anything else: Message.
func Whose(ctx context.Context, err error, conn *pgx.Conn) Verdict {
	switch {
	case err == nil:
		return None
	case errors.Is(ctx.Err(), context.Canceled):
		return Stopping
	case ctx.Err() != nil, errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		return Message
	case OfTransaction(err, conn):
		return Transaction
	}
	return Message
}

// OfTransaction reports whether err is a failure of the transaction's own connection or server,
// so that running the same work again, unchanged, may succeed. conn is the transaction's
// connection (nil when unknown). True for:
//
//   - a *pgconn.PgError of SQLSTATE class 40 (serialization failure, deadlock, statement
//     completion unknown) except 40002 (an integrity constraint violated at commit: the data's
//     fault), class 08 (connection exceptions), class 53 (insufficient resources: disk full,
//     out of memory, too many connections), 55P03 (lock_not_available: lock_timeout), 57014
//     (query_canceled: statement_timeout) and 57P01–57P03 (the server shutting down, crashed,
//     starting up);
//   - a connection that could not be made (*pgconn.ConnectError);
//   - pgconn's timeout of a statement (pgconn.Timeout): the network, or the engine's own
//     commit timeout;
//   - pgconn.SafeToRetry errors (nothing was sent), except `conn busy` (a handler left a
//     query's rows open: it fails the same way every time) and `conn closed` (decided below);
//   - conn found closed: pgx reports a connection lost mid-statement as an I/O error or as
//     `conn closed` on the statement in flight and every later one — which is also what a
//     handler's misuse of another, closed connection returns; whether the transaction's own
//     connection is closed tells the two apart.
//
// Anything else is not: in particular a net.Error, io.EOF, ECONNREFUSED or a context error that
// did not come from the transaction's connection (an HTTP client's, a decoder's).
func OfTransaction(err error, conn *pgx.Conn) bool {
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && transientCode(pgErr.Code) {
		return true
	}
	var connErr *pgconn.ConnectError
	switch {
	case errors.As(err, &connErr), pgconn.Timeout(err):
		return true
	case pgconn.SafeToRetry(err) && !connBusy(err) && !errors.Is(err, pgconn.ErrConnClosed) && pgErr == nil:
		return true
	}
	return conn != nil && conn.IsClosed()
}

func transientCode(c string) bool {
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

// connBusy reports pgx's `conn busy`: a statement sent while a query's rows were still open on
// the connection. pgconn marks it SafeToRetry (nothing was sent), but it is a handler's bug.
func connBusy(err error) bool {
	for ; err != nil; err = errors.Unwrap(err) {
		if _, ok := err.(interface{ SafeToRetry() bool }); ok && err.Error() == "conn busy" {
			return true
		}
	}
	return false
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

// String names the verdict, for logs and test failures.
func (v Verdict) String() string {
	switch v {
	case None:
		return "none"
	case Stopping:
		return "stopping"
	case Transaction:
		return "transaction"
	case Message:
		return "message"
	}
	return "Verdict(" + strconv.Itoa(int(v)) + ")"
}
