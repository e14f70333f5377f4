package pgsql

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ErrTxAborted is what a managed view's done function returns when the handler returned but
// its transaction is in the failed state: a statement failed and the handler carried on, so
// nothing it did can commit.
var ErrTxAborted = errors.New("the handler's transaction is aborted: a statement in it failed and the handler carried on; " +
	"return that statement's error, or run statements that may fail in a savepoint (tx.Begin)")

// ErrRowsOpen is what a managed view's done function returns when the handler returned with a
// query's rows still open: the connection is busy, so the middleware can neither write nor
// commit on it.
var ErrRowsOpen = errors.New("the handler returned with a query's rows still open (pgx: conn busy): " +
	"close them (defer rows.Close(), or read them with pgx.CollectRows) before returning")

// ManagedTx returns the view of tx that a middleware hands to user code: everything but
// ending it. Commit and Rollback on the view return errManaged, because the middleware ends
// the transaction itself (after writing what must commit with the user's writes); savepoints
// from Begin are the user's to end.
//
// SQL that would end or restart the transaction (COMMIT, ROLLBACK, END, ABORT, BEGIN, START
// TRANSACTION, PREPARE TRANSACTION: see TxControl) is refused before it is sent, through
// Exec, Query, QueryRow, SendBatch and Prepare, with an error wrapping errManaged. Refusing
// is what keeps the guarantee: a COMMIT that reached the server would have committed the
// dedup row or the handler's writes, which nothing can take back.
//
// done closes the view — every method then fails with pgx.ErrTxClosed, so a goroutine that
// kept it cannot write on a connection that is back in the pool — and reports whether the
// handler may be trusted to have left the transaction as it got it: an error wrapping
// errManaged when a statement was refused, or when the connection is no longer in the
// transaction (ended around the view, through tx.Conn()); ErrRowsOpen when a query's rows
// were left open; ErrTxAborted when the transaction is in the failed state. The middleware must then fail the attempt, roll back, and record
// nothing.
func ManagedTx(tx pgx.Tx, errManaged error) (view pgx.Tx, done func() error) {
	st := &viewState{errManaged: errManaged}
	return &managedTx{Tx: tx, st: st}, func() error { return st.done(tx) }
}

// viewState is shared by a view and the savepoint views made from it.
type viewState struct {
	errManaged error
	mu         sync.Mutex
	closed     bool
	refused    string // the first transaction-control statement refused
}

func (s *viewState) check() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return pgx.ErrTxClosed
	}
	return nil
}

// checkSQL refuses a statement list that holds transaction control, remembering it.
func (s *viewState) checkSQL(sql string) error {
	if err := s.check(); err != nil {
		return err
	}
	stmt := TxControl(sql)
	if stmt == "" {
		return nil
	}
	s.mu.Lock()
	if s.refused == "" {
		s.refused = stmt
	}
	s.mu.Unlock()
	return fmt.Errorf("%w: %s would end or restart the transaction, so it was not sent, and this attempt will fail; "+
		"savepoints are allowed (tx.Begin, SAVEPOINT, ROLLBACK TO SAVEPOINT)", s.errManaged, stmt)
}

func (s *viewState) done(tx pgx.Tx) error {
	s.mu.Lock()
	s.closed = true
	refused := s.refused
	s.mu.Unlock()
	if refused != "" {
		return fmt.Errorf("%w: the handler sent %s on its transaction; the statement was refused and the attempt fails, so nothing of it is kept",
			s.errManaged, refused)
	}
	conn := tx.Conn()
	if conn == nil || conn.IsClosed() {
		return nil // the connection broke: the commit fails and says so
	}
	if conn.PgConn().IsBusy() {
		return ErrRowsOpen
	}
	switch conn.PgConn().TxStatus() {
	case 'I':
		return fmt.Errorf("%w: the handler's transaction was ended outside the middleware (SQL sent on tx.Conn(), around the view): "+
			"what the handler wrote before that was committed or rolled back beyond the middleware's control; nothing more is written and the attempt fails",
			s.errManaged)
	case 'E':
		return ErrTxAborted
	}
	return nil
}

type managedTx struct {
	pgx.Tx
	st     *viewState
	nested bool // a savepoint from Begin: the user may end it
}

func (t *managedTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := t.st.check(); err != nil {
		return nil, err
	}
	sp, err := t.Tx.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return &managedTx{Tx: sp, st: t.st, nested: true}, nil
}

func (t *managedTx) Commit(ctx context.Context) error {
	if !t.nested {
		return t.st.errManaged
	}
	if err := t.st.check(); err != nil {
		return err
	}
	return t.Tx.Commit(ctx)
}

func (t *managedTx) Rollback(ctx context.Context) error {
	if !t.nested {
		return t.st.errManaged
	}
	if err := t.st.check(); err != nil {
		return err
	}
	return t.Tx.Rollback(ctx)
}

func (t *managedTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	if err := t.st.check(); err != nil {
		return 0, err
	}
	return t.Tx.CopyFrom(ctx, table, cols, src)
}

func (t *managedTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	for _, q := range b.QueuedQueries {
		if err := t.st.checkSQL(q.SQL); err != nil {
			return pgx.FailedBatchResults(b, err)
		}
	}
	if err := t.st.check(); err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	return t.Tx.SendBatch(ctx, b)
}

func (t *managedTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := t.st.checkSQL(sql); err != nil {
		return nil, err
	}
	return t.Tx.Prepare(ctx, name, sql)
}

func (t *managedTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if err := t.st.checkSQL(sql); err != nil {
		return pgconn.CommandTag{}, err
	}
	return t.Tx.Exec(ctx, sql, args...)
}

func (t *managedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if err := t.st.checkSQL(sql); err != nil {
		return nil, err
	}
	return t.Tx.Query(ctx, sql, args...)
}

func (t *managedTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if err := t.st.checkSQL(sql); err != nil {
		return errRow{err}
	}
	return t.Tx.QueryRow(ctx, sql, args...)
}

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }
