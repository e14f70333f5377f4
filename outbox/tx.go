package outbox

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
)

// txKey is THE transaction-in-context key of onceflow: the inbox and idempotency middlewares
// put the handler's transaction under it, ContextPublisher and user code read it back.
type txKey struct{}

// ContextWithTx returns a context carrying tx. The inbox and idempotency middlewares call it
// for their handlers; call it yourself to publish through ContextPublisher (a cqrs.EventBus)
// inside a transaction you opened.
func ContextWithTx(ctx context.Context, tx pgx.Tx) context.Context {
	return context.WithValue(ctx, txKey{}, tx)
}

// TxFromContext returns the transaction stored by ContextWithTx, and whether there is one.
// A handler behind the inbox or idempotency middleware finds the transaction the middleware
// opened: its writes on it commit together with the dedup row or the stored response, or not
// at all. Commit and Rollback on that transaction return an error wrapping ErrTxManaged.
// An HTTP handler that also serves requests without an Idempotency-Key gets ok == false for
// those and opens its own transaction.
func TxFromContext(ctx context.Context) (pgx.Tx, bool) {
	tx, ok := ctx.Value(txKey{}).(pgx.Tx)
	return tx, ok && tx != nil
}

// MustTx is TxFromContext for handlers that always run behind a middleware: it panics, with a
// message saying what to install, when ctx carries no transaction, because writing outside it
// would silently give up the exactly-once effect.
//
//	tx := outbox.MustTx(msg.Context()) // inside an inbox handler
func MustTx(ctx context.Context) pgx.Tx {
	tx, ok := TxFromContext(ctx)
	if !ok {
		panic("onceflow: no transaction in this context: run the handler behind the inbox middleware " +
			"(router.AddMiddleware(ib.Middleware); pass msg.Context()) or the idempotency middleware " +
			"(pass r.Context()), or put one there with outbox.ContextWithTx")
	}
	return tx
}

// ErrTxManaged is wrapped by the error that Commit and Rollback return on a transaction a
// middleware handed to a handler (inbox, idempotency, saga), and by the error for SQL that
// would end it (COMMIT, ROLLBACK, END, ABORT, BEGIN, PREPARE TRANSACTION in Exec or Query): the
// middleware ends it itself, after writing what must commit with the handler's writes. To abort, fail the handler
// (return an error from a message handler; respond with a status that is not stored from an
// HTTP handler). errors.Is(err, ErrTxManaged) holds whichever middleware opened it.
var ErrTxManaged = errors.New("onceflow: the middleware that opened this transaction commits or rolls it back itself")

// ErrNoTx is returned by ContextPublisher when a message's context carries no transaction.
// Publishing outside a transaction would break the atomic-write guarantee, so it is refused.
var ErrNoTx = errors.New("outbox: no transaction in the message context; wrap the context with outbox.ContextWithTx(ctx, tx) before publishing")
