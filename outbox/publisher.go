package outbox

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
)

// NewTxPublisher returns a Watermill publisher that writes into the outbox as part of tx,
// using the default writer. Publish is WriteTx; Close does nothing (the caller owns tx).
func NewTxPublisher(ctx context.Context, tx pgx.Tx) message.Publisher {
	return defaultWriter.TxPublisher(ctx, tx)
}

// TxPublisher returns a Watermill publisher that writes into the outbox as part of tx.
// Use one per transaction; it must not outlive tx.
func (w *Writer) TxPublisher(ctx context.Context, tx pgx.Tx) message.Publisher {
	return txPublisher{ctx: ctx, tx: tx, w: w}
}

type txPublisher struct {
	ctx context.Context
	tx  pgx.Tx
	w   *Writer
}

func (p txPublisher) Publish(topic string, msgs ...*message.Message) error {
	return p.w.WriteTx(p.ctx, p.tx, topic, msgs...)
}

func (txPublisher) Close() error { return nil }

// ContextPublisher returns a long-lived Watermill publisher that writes each call into the
// transaction found in the messages' context (see ContextWithTx). It fits a cqrs.EventBus,
// which sets the context passed to EventBus.Publish on the message:
//
//	bus, _ := cqrs.NewEventBusWithConfig(writer.ContextPublisher(), cfg)
//	err := bus.Publish(outbox.ContextWithTx(ctx, tx), OrderPlaced{...})
//
// A message without a transaction in its context is refused with ErrNoTx.
func (w *Writer) ContextPublisher() message.Publisher { return contextPublisher{w: w} }

type contextPublisher struct{ w *Writer }

func (p contextPublisher) Publish(topic string, msgs ...*message.Message) error {
	if len(msgs) == 0 {
		return fmt.Errorf("outbox: %w", ErrNoMessages)
	}
	ctx := msgs[0].Context()
	tx, ok := TxFromContext(ctx)
	if !ok {
		return ErrNoTx
	}
	for i, m := range msgs[1:] {
		if other, _ := TxFromContext(m.Context()); other != tx {
			return fmt.Errorf("outbox: message %d carries a different transaction than message 0; publish them in separate calls", i+1)
		}
	}
	return p.w.WriteTx(ctx, tx, topic, msgs...)
}

func (contextPublisher) Close() error { return nil }
