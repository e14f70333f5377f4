package outbox

import (
	"context"
	"database/sql"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/internal/sqltx"
)

// WriteSQLTx writes msgs with the default configuration into a database/sql transaction.
// See Writer.WriteSQLTx.
func WriteSQLTx(ctx context.Context, tx *sql.Tx, topic string, msgs ...*message.Message) error {
	return defaultWriter.WriteSQLTx(ctx, tx, topic, msgs...)
}

// WriteSQLTx is WriteTx for code written against database/sql: it inserts msgs into the
// outbox as part of tx, a *sql.Tx of any PostgreSQL driver (pgx's stdlib, lib/pq), with the
// same statement, the same single round trip, the same validation and the same guarantees
// as WriteTx: the rows commit with tx or not at all. Array arguments travel as PostgreSQL
// array literals, which every driver can send, so no driver-specific type is needed.
func (w *Writer) WriteSQLTx(ctx context.Context, tx *sql.Tx, topic string, msgs ...*message.Message) error {
	return w.write(ctx, sqltx.Std(tx), topic, msgs)
}

// NewSQLTxPublisher is NewTxPublisher for a database/sql transaction: a Watermill publisher
// whose Publish is WriteSQLTx on tx, for code built around watermill-sql's publisher (which
// also takes a *sql.Tx). Close does nothing; the caller owns tx.
func NewSQLTxPublisher(ctx context.Context, tx *sql.Tx) message.Publisher {
	return defaultWriter.SQLTxPublisher(ctx, tx)
}

// SQLTxPublisher returns a Watermill publisher that writes into the outbox as part of the
// database/sql transaction tx. Use one per transaction; it must not outlive tx.
func (w *Writer) SQLTxPublisher(ctx context.Context, tx *sql.Tx) message.Publisher {
	return sqlTxPublisher{ctx: ctx, tx: tx, w: w}
}

type sqlTxPublisher struct {
	ctx context.Context
	tx  *sql.Tx
	w   *Writer
}

func (p sqlTxPublisher) Publish(topic string, msgs ...*message.Message) error {
	return p.w.WriteSQLTx(p.ctx, p.tx, topic, msgs...)
}

func (sqlTxPublisher) Close() error { return nil }
