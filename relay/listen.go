package relay

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/outbox"
)

// signal wakes the publishing loop (coalescing: one pending wake-up is enough).
func (r *Relay) signal() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// listenerCheck is how often an idle listener checks its connection.
const listenerCheck = 30 * time.Second

// listen holds a dedicated connection LISTENing on the outbox channel and wakes the loop on
// every notification. It reconnects with backoff when the connection drops, and wakes the loop
// after reconnecting because rows may have committed while nobody listened.
func (r *Relay) listen(ctx context.Context) {
	channel := pgx.Identifier{outbox.NotifyChannel(r.cfg.Schema)}.Sanitize()
	fails := 0
	for ctx.Err() == nil {
		err := func() error {
			conn, err := pgx.ConnectConfig(ctx, r.pool.Config().ConnConfig.Copy())
			if err != nil {
				return fmt.Errorf("connect: %w", err)
			}
			defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }() // nothing to do if closing fails
			if _, err := conn.Exec(ctx, "LISTEN "+channel); err != nil {
				return fmt.Errorf("LISTEN %s: %w", channel, err)
			}
			r.listening.Store(true)
			defer r.listening.Store(false)
			if fails > 0 {
				r.log.Info("relay listener reconnected", "channel", channel)
			}
			fails = 0
			r.signal()
			for {
				// Wake up now and then to check the connection: one that died without a reset
				// would otherwise leave the relay on the poll fallback until TCP gives up.
				wctx, cancel := context.WithTimeout(ctx, listenerCheck)
				_, err := conn.WaitForNotification(wctx)
				cancel()
				switch {
				case err == nil:
					r.signal()
				case ctx.Err() != nil:
					return ctx.Err()
				case errors.Is(err, context.DeadlineExceeded):
					pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
					err = conn.Ping(pctx)
					cancel()
					if err != nil {
						return fmt.Errorf("listener connection check: %w", err)
					}
				default:
					return err
				}
			}
		}()
		if ctx.Err() != nil {
			return
		}
		fails++
		d := backoffDelay(100*time.Millisecond, 5*time.Second, fails, rand.Float64())
		r.log.Warn("relay listener lost; polling every PollInterval until it reconnects", "err", err, "retry_in", d.Round(time.Millisecond))
		select {
		case <-ctx.Done():
			return
		case <-time.After(d):
		}
	}
}
