// Package redisdedup deduplicates messages whose effect is not in PostgreSQL — sending an
// email, calling a partner API — with a Redis key per message (SET key value NX PX ttl).
//
// Its guarantee is WEAKER than the inbox's, and cannot be otherwise: the effect and the
// record of it are not in one transaction.
//
//   - A crash (or a lost connection to Redis) between the effect and the record repeats the
//     effect: the redelivery finds no "done" record once the claim's lease expires, and runs
//     the handler again. Use the PostgreSQL inbox when the effect can live in PostgreSQL.
//   - A failed effect must release the key, or the message would be skipped forever; the
//     middleware releases it when the handler returns an error or panics.
//
// Each message goes through three states:
//
//	(absent) --claim: SET NX PX Lease--> processing --handler ok: SET PX Window--> done
//	                                         \--handler error/panic: DEL (own claim only)--> (absent)
//
// A delivery that finds "done" is acknowledged as a duplicate. One that finds "processing"
// (another consumer has it, or a crashed one held it less than Lease ago) fails with
// ErrInProgress, so the broker redelivers it later rather than acknowledging a message whose
// effect may yet fail.
//
// Messages the handler returns are published by the router after the key is marked done; if
// that publish fails, the redelivery is skipped as a duplicate and they are not sent again.
// Handlers that must emit events reliably should use the PostgreSQL inbox and the outbox.
package redisdedup

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/onceflow/onceflow/internal/config"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/inbox"
	cleaning "github.com/onceflow/onceflow/internal/retention"
)

// Defaults.
const (
	// DefaultPrefix starts every key.
	DefaultPrefix = "onceflow:dedup:"
	// DefaultWindow is how long a "done" record is kept: 72h, the inbox's DefaultWindow.
	DefaultWindow = inbox.DefaultWindow
	// DefaultLease is how long a claim protects a message being processed.
	DefaultLease = time.Minute
)

// ErrInProgress is returned (wrapped) when another delivery of the message holds the claim.
// The message is nacked and redelivered; it is skipped once the other delivery marks it done,
// or run again if that one fails or its lease expires.
var ErrInProgress = errors.New("redisdedup: another delivery of this message is being processed; it will be redelivered")

// Config configures a Store. Client and Consumer are required.
type Config struct {
	// Client is the Redis connection. Required. A redis.ClusterClient works: each message is
	// one key.
	Client redis.UniversalClient
	// Consumer names the consumer; it is part of every key. Required; must not contain ':'.
	Consumer string
	// KeyFunc returns a message's dedup key. Default inbox.DefaultKey.
	KeyFunc inbox.KeyFunc
	// Prefix starts every key. Default "onceflow:dedup:", giving keys such as
	// onceflow:dedup:mailer:event:0193….
	Prefix string
	// Window is how long a "done" record is kept (its Redis TTL), as inbox.CleanerConfig.Window
	// is for processed_event rows. Default DefaultWindow (72h). It must exceed the longest
	// redelivery horizon: a redelivery after the record expired runs the handler again.
	Window time.Duration
	// AllowShortWindow accepts a Window under retention.MinWindow (24h), for tests and
	// consumers whose redelivery horizon is provably short. Default false: such a window is
	// refused.
	AllowShortWindow bool
	// Lease is how long a claim protects a message being processed. Default 1m. It must exceed
	// the handler's longest run (bound it with middleware.Timeout); a crashed consumer's
	// message is redelivered and run again once its lease expires.
	Lease time.Duration
	// NoKeyPolicy decides what happens to a message without a usable key. Default
	// inbox.RejectNoKey.
	NoKeyPolicy inbox.NoKeyPolicy
	// Logger receives duplicates (debug), failed records and releases (error). Default
	// slog.Default().
	Logger *slog.Logger
	// Metrics counts messages like the inbox does (Failed includes ErrInProgress). Default none.
	Metrics inbox.Metrics
}

// Store is a Redis dedup store for one consumer. It is safe for concurrent use.
type Store struct {
	cfg Config
}

// New validates cfg, reporting every problem at once, and returns a Store.
func New(cfg Config) (*Store, error) {
	if cfg.Prefix == "" {
		cfg.Prefix = DefaultPrefix
	}
	if cfg.Window == 0 {
		cfg.Window = DefaultWindow
	}
	if cfg.Lease == 0 {
		cfg.Lease = DefaultLease
	}
	var problems []error
	if cfg.Client == nil {
		problems = append(problems, errors.New("Client is nil; pass a *redis.Client (github.com/redis/go-redis/v9)"))
	}
	switch {
	case cfg.Consumer == "":
		problems = append(problems, errors.New(`Consumer is empty; name the consumer (e.g. "mailer"): it is part of every key`))
	case strings.ContainsAny(cfg.Consumer, ":\x00") || len(cfg.Consumer) > inbox.MaxConsumerBytes:
		problems = append(problems, fmt.Errorf("Consumer %q must not contain ':' or NUL and must be at most %d bytes", cfg.Consumer, inbox.MaxConsumerBytes))
	}
	if err := cleaning.CheckWindow("Window", cfg.Window, cfg.AllowShortWindow, "AllowShortWindow"); err != nil {
		problems = append(problems, err)
	}
	if cfg.Lease < time.Millisecond {
		problems = append(problems, fmt.Errorf("Lease is %s; use 0 for the default (%s) or at least 1ms, longer than the handler's longest run", cfg.Lease, DefaultLease))
	}
	if cfg.NoKeyPolicy != inbox.RejectNoKey && cfg.NoKeyPolicy != inbox.DropNoKey {
		problems = append(problems, fmt.Errorf("NoKeyPolicy is %v; use inbox.RejectNoKey (default) or inbox.DropNoKey", cfg.NoKeyPolicy))
	}
	if err := config.Check("redisdedup", problems...); err != nil {
		return nil, err
	}
	if cfg.KeyFunc == nil {
		cfg.KeyFunc = inbox.DefaultKey
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	cfg.Logger = cfg.Logger.With("consumer", cfg.Consumer)
	if cfg.Metrics == nil {
		cfg.Metrics = nopMetrics{}
	}
	return &Store{cfg: cfg}, nil
}

// Config returns the configuration with defaults filled in.
func (s *Store) Config() Config { return s.cfg }

// Outcome is the result of a claim.
type Outcome int

const (
	// Claimed: the caller owns the message for Lease; run the effect, then MarkDone or Release.
	Claimed Outcome = iota + 1
	// Done: the message was processed already; skip it.
	Done
	// InProgress: another delivery holds the claim; retry later.
	InProgress
)

// String returns the outcome's name.
func (o Outcome) String() string {
	switch o {
	case Claimed:
		return "Claimed"
	case Done:
		return "Done"
	case InProgress:
		return "InProgress"
	}
	return fmt.Sprintf("Outcome(%d)", int(o))
}

// Claim is the result of Store.Claim; pass it to MarkDone or Release.
type Claim struct {
	Outcome Outcome
	key     string // the Redis key
	token   string // this claim's value, "p:<random>"
}

// The value of a key says its state: "p:<token>" processing, "d:<token>" done.
const (
	processingPrefix = "p:"
	donePrefix       = "d:"
)

// claimScript claims the key or says why not, atomically: a separate GET after a failed
// SET NX could see the key expire in between.
var claimScript = redis.NewScript(`
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, 2) == 'd:' then return 2 end
return 3`)

// releaseScript deletes the key only if it still holds this claim, so a slow consumer whose
// lease expired never deletes another consumer's claim or done record.
var releaseScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0`)

// Key returns the Redis key of a dedup key: Prefix + Consumer + ":" + dedupKey.
func (s *Store) Key(dedupKey string) string { return s.cfg.Prefix + s.cfg.Consumer + ":" + dedupKey }

// Claim tries to take the message with dedupKey for Lease. See Outcome.
func (s *Store) Claim(ctx context.Context, dedupKey string) (Claim, error) {
	var b [16]byte
	_, _ = rand.Read(b[:])
	c := Claim{key: s.Key(dedupKey), token: processingPrefix + hex.EncodeToString(b[:])}
	res, err := claimScript.Run(ctx, s.cfg.Client, []string{c.key}, c.token, s.cfg.Lease.Milliseconds()).Int()
	if err != nil {
		return Claim{}, fmt.Errorf("redisdedup: claim %q: %w", c.key, err)
	}
	c.Outcome = Outcome(res)
	return c, nil
}

// MarkDone records that the claimed message's effect happened, for Window. It overwrites the key
// whatever it holds: the effect did happen, and a concurrent claimer (possible only after this
// claim's lease expired) can no longer release the record.
func (s *Store) MarkDone(ctx context.Context, c Claim) error {
	if c.Outcome != Claimed {
		return fmt.Errorf("redisdedup: MarkDone on a %v claim", c.Outcome)
	}
	done := donePrefix + strings.TrimPrefix(c.token, processingPrefix)
	if err := s.cfg.Client.Set(ctx, c.key, done, s.cfg.Window).Err(); err != nil {
		return fmt.Errorf("redisdedup: mark %q done: %w", c.key, err)
	}
	return nil
}

// Release gives up the claim after a failed effect, so the redelivery runs it again. It
// deletes the key only if it still holds this claim.
func (s *Store) Release(ctx context.Context, c Claim) error {
	if c.Outcome != Claimed {
		return fmt.Errorf("redisdedup: Release on a %v claim", c.Outcome)
	}
	if err := releaseScript.Run(ctx, s.cfg.Client, []string{c.key}, c.token).Err(); err != nil {
		return fmt.Errorf("redisdedup: release %q: %w", c.key, err)
	}
	return nil
}

// detachedTimeout bounds MarkDone and Release, which run on a context detached from the
// message's: the effect has happened (or failed) and its record must be written even if the
// message's context was cancelled.
const detachedTimeout = 10 * time.Second

// Middleware is the message.HandlerMiddleware: claim, run the handler, then mark done (on
// success) or release (on error or panic). A duplicate is acknowledged without running the
// handler; a message in progress elsewhere fails with ErrInProgress.
//
// If marking done fails after a successful handler, the message is still acknowledged (the
// effect happened; failing it would repeat the effect at once) and the failure is logged:
// a later redelivery, after the lease expires, would repeat the effect.
func (s *Store) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) (_ []*message.Message, err error) {
		key, err := s.cfg.KeyFunc(msg)
		if err != nil {
			if !errors.Is(err, inbox.ErrNoKey) {
				err = fmt.Errorf("%w: KeyFunc: %w", inbox.ErrNoKey, err)
			}
		} else if key == "" {
			err = fmt.Errorf("%w: the key is empty", inbox.ErrNoKey)
		}
		if err != nil {
			s.cfg.Metrics.NoKey(s.cfg.Consumer)
			if s.cfg.NoKeyPolicy == inbox.DropNoKey {
				s.cfg.Logger.Warn("redisdedup: message without a dedup key dropped (acknowledged, handler not run)", "message_uuid", msg.UUID, "err", err)
				return nil, nil
			}
			return nil, fmt.Errorf("redisdedup: consumer %q, message %q: %w", s.cfg.Consumer, msg.UUID, err)
		}

		c, err := s.Claim(msg.Context(), key)
		if err != nil {
			s.cfg.Metrics.Failed(s.cfg.Consumer)
			return nil, err
		}
		switch c.Outcome {
		case Done:
			s.cfg.Metrics.Duplicate(s.cfg.Consumer)
			s.cfg.Logger.Debug("redisdedup: duplicate skipped", "message_uuid", msg.UUID, "key", c.key)
			return nil, nil
		case InProgress:
			s.cfg.Metrics.Failed(s.cfg.Consumer)
			return nil, fmt.Errorf("%w (key %q)", ErrInProgress, c.key)
		}

		start := time.Now()
		ok := false
		defer func() {
			if ok {
				return
			}
			// Handler error or panic (which keeps unwinding): give the message back.
			s.cfg.Metrics.Failed(s.cfg.Consumer)
			ctx, cancel := context.WithTimeout(context.WithoutCancel(msg.Context()), detachedTimeout)
			defer cancel()
			if rerr := s.Release(ctx, c); rerr != nil {
				s.cfg.Logger.Error("redisdedup: could not release the claim of a failed message; it is retried after the lease expires",
					"message_uuid", msg.UUID, "err", rerr, "lease", s.cfg.Lease)
			}
		}()
		produced, err := h(msg)
		if err != nil {
			return nil, err
		}
		ok = true
		ctx, cancel := context.WithTimeout(context.WithoutCancel(msg.Context()), detachedTimeout)
		defer cancel()
		if merr := s.MarkDone(ctx, c); merr != nil {
			s.cfg.Logger.Error("redisdedup: effect applied but not recorded; a redelivery after the lease expires would repeat it",
				"message_uuid", msg.UUID, "err", merr)
		}
		s.cfg.Metrics.Processed(s.cfg.Consumer, time.Since(start))
		return produced, nil
	}
}

type nopMetrics struct{}

func (nopMetrics) Processed(string, time.Duration) {}
func (nopMetrics) Duplicate(string)                {}
func (nopMetrics) Failed(string)                   {}
func (nopMetrics) NoKey(string)                    {}
func (nopMetrics) Poisoned(string)                 {}
func (nopMetrics) Parked(string)                   {}
