package pgsql

import (
	"context"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ManagedTx returns the view of tx that a middleware hands to user code: everything but
// ending it. Commit and Rollback on the view return errManaged, because the middleware ends
// the transaction itself (after writing what must commit with the user's writes); savepoints
// from Begin are the user's to end. Once closeView is called every method fails with
// pgx.ErrTxClosed, so a goroutine that kept the view cannot write on a connection that is
// back in the pool.
func ManagedTx(tx pgx.Tx, errManaged error) (view pgx.Tx, closeView func()) {
	closed := new(atomic.Bool)
	return &managedTx{Tx: tx, closed: closed, errManaged: errManaged}, func() { closed.Store(true) }
}

type managedTx struct {
	pgx.Tx
	closed     *atomic.Bool
	errManaged error
	nested     bool // a savepoint from Begin: the user may end it
}

func (t *managedTx) check() error {
	if t.closed.Load() {
		return pgx.ErrTxClosed
	}
	return nil
}

func (t *managedTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := t.check(); err != nil {
		return nil, err
	}
	sp, err := t.Tx.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return &managedTx{Tx: sp, closed: t.closed, errManaged: t.errManaged, nested: true}, nil
}

func (t *managedTx) Commit(ctx context.Context) error {
	if !t.nested {
		return t.errManaged
	}
	if err := t.check(); err != nil {
		return err
	}
	return t.Tx.Commit(ctx)
}

func (t *managedTx) Rollback(ctx context.Context) error {
	if !t.nested {
		return t.errManaged
	}
	if err := t.check(); err != nil {
		return err
	}
	return t.Tx.Rollback(ctx)
}

func (t *managedTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	if err := t.check(); err != nil {
		return 0, err
	}
	return t.Tx.CopyFrom(ctx, table, cols, src)
}

func (t *managedTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if err := t.check(); err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	return t.Tx.SendBatch(ctx, b)
}

func (t *managedTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := t.check(); err != nil {
		return nil, err
	}
	return t.Tx.Prepare(ctx, name, sql)
}

func (t *managedTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if err := t.check(); err != nil {
		return pgconn.CommandTag{}, err
	}
	return t.Tx.Exec(ctx, sql, args...)
}

func (t *managedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if err := t.check(); err != nil {
		return nil, err
	}
	return t.Tx.Query(ctx, sql, args...)
}

func (t *managedTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if err := t.check(); err != nil {
		return errRow{err}
	}
	return t.Tx.QueryRow(ctx, sql, args...)
}

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }
