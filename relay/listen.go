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

// How long a listener waits for its probe notification, and how long the relay polls before
// trying a listener again after a probe that did not arrive.
var (
	listenProbeTimeout = 5 * time.Second
	listenRecheck      = time.Minute
)

// errListenDeaf is a listener connection on which notifications do not arrive.
var errListenDeaf = errors.New("relay: notifications do not arrive on the listener connection")

// listen holds a dedicated connection LISTENing on the outbox channel and wakes the loop on
// every notification. It reconnects with backoff when the connection drops, and wakes the loop
// after reconnecting because rows may have committed while nobody listened.
func (r *Relay) listen(ctx context.Context) {
	channel := pgx.Identifier{outbox.NotifyChannel(r.cfg.Schema)}.Sanitize()
	fails := 0
	deafWarned := false
	for ctx.Err() == nil {
		err := func() error {
			cfg := r.cfg.ListenConnConfig
			if cfg == nil {
				cfg = r.pool.Config().ConnConfig
			}
			conn, err := pgx.ConnectConfig(ctx, cfg.Copy())
			if err != nil {
				return fmt.Errorf("connect: %w", err)
			}
			defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }() // nothing to do if closing fails
			// The probe first: the outbox channel's LISTEN stays the connection's last
			// statement (what pg_stat_activity shows for it), and a write committed meanwhile
			// is found by the claim signalled below.
			if err := r.probeListen(ctx, conn); err != nil {
				return err
			}
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
					select {
					case r.schedWake <- struct{}{}:
					default:
					}
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
		var deaf *deafListenerError
		switch {
		case errors.As(err, &deaf):
			// Not a lost connection but a route on which LISTEN cannot work: say once what to
			// change, then look again now and then (a pooler's mode or a DNS name may change).
			d = listenRecheck
			if !deafWarned {
				deafWarned = true
				r.log.Warn(deaf.advice(), "err", err, "recheck_in", d)
			} else {
				r.log.Debug("relay listener still receives no notifications; polling", "err", err, "recheck_in", d)
			}
		default:
			r.log.Warn("relay listener lost; polling every PollInterval until it reconnects", "err", err, "retry_in", d.Round(time.Millisecond))
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(d):
		}
	}
}

// probeListen checks, once per listener connection, that notifications reach it: it LISTENs
// on a channel of its own, sends a NOTIFY on it through Pool (the way writers notify) and
// waits for it. Behind a pooler in transaction or statement mode (PgBouncer's default
// advice for many clients) the LISTEN succeeds but binds a server connection the pooler
// gives back to its pool when the statement ends: nothing ever arrives, and a relay trusting
// it would mark itself asleep, make writers pay for a NOTIFY on every commit, and find their
// rows only by its PollInterval fallback. A probe that does not arrive returns a
// *deafListenerError, so the relay stays awake (writers do not notify) and says what to do.
func (r *Relay) probeListen(ctx context.Context, conn *pgx.Conn) error {
	var b [8]byte
	for i := range b {
		b[i] = byte(rand.Uint32())
	}
	probe := fmt.Sprintf("onceflow_relay_probe_%x", b) // 37 bytes: a valid channel name
	if _, err := conn.Exec(ctx, "LISTEN "+probe); err != nil {
		return fmt.Errorf("LISTEN %s: %w", probe, err)
	}
	sendCtx, cancel := context.WithTimeout(ctx, listenProbeTimeout)
	_, err := r.pool.Exec(sendCtx, "SELECT pg_notify($1, 'probe')", probe)
	cancel()
	if err != nil {
		return fmt.Errorf("send the listener's probe NOTIFY through Pool: %w", err)
	}
	deadline := time.Now().Add(listenProbeTimeout)
	for {
		wctx, cancel := context.WithDeadline(ctx, deadline)
		n, err := conn.WaitForNotification(wctx)
		cancel()
		switch {
		case err == nil && n.Channel == probe:
			if _, err := conn.Exec(ctx, "UNLISTEN "+probe); err != nil {
				return fmt.Errorf("UNLISTEN %s: %w", probe, err)
			}
			return nil
		case err == nil: // not ours (the connection listens to nothing else yet): wait on
		case ctx.Err() != nil:
			return ctx.Err()
		case errors.Is(err, context.DeadlineExceeded):
			return &deafListenerError{wait: listenProbeTimeout, pooled: throughPooler(ctx, conn)}
		default:
			return err
		}
	}
}

// throughPooler reports whether conn reaches PostgreSQL through a connection pooler: the
// backend pid the server reports differs from the one the connection announced at start-up
// (PgBouncer, for one, announces a key of its own, in every pool mode). Only a hint for the
// warning: a session-mode pooler differs too, and there LISTEN works.
func throughPooler(ctx context.Context, conn *pgx.Conn) bool {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var pid uint32
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		return false
	}
	return pid != conn.PgConn().PID()
}

// deafListenerError is a listener connection whose probe notification did not arrive.
type deafListenerError struct {
	wait   time.Duration
	pooled bool // the connection goes through a pooler (throughPooler)
}

func (e *deafListenerError) Error() string {
	if e.pooled {
		return fmt.Sprintf("%v within %s, and the connection goes through a connection pooler", errListenDeaf, e.wait)
	}
	return fmt.Sprintf("%v within %s", errListenDeaf, e.wait)
}

func (e *deafListenerError) Unwrap() error { return errListenDeaf }

// advice is the warning's message: what happens now and what to change.
func (e *deafListenerError) advice() string {
	why := "a NOTIFY sent through Pool did not reach the listener connection"
	if e.pooled {
		why = "the listener connection goes through a connection pooler in transaction or statement mode " +
			"(e.g. PgBouncer pool_mode=transaction), where LISTEN lasts one statement"
	}
	return "relay: LISTEN/NOTIFY does not work here: " + why + ". The relay keeps publishing but polls: " +
		"rows written while it is idle wait up to PollInterval. To be woken at once, give the listener a direct or " +
		"session-mode connection to the primary (relay.Config.ListenConnConfig; onceflow relay --listen-database-url); " +
		"to poll without this check, set DisableListen (onceflow relay --no-listen)"
}
