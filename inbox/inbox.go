// Package inbox makes a Watermill handler apply each message's effect exactly once, however
// often the broker delivers it.
//
// The middleware runs every message in ONE PostgreSQL transaction that holds
//
//   - the dedup row (consumer, key) in processed_event, inserted with ON CONFLICT DO NOTHING:
//     when it already exists the handler is skipped and the message acknowledged;
//   - the handler's own writes, made on the transaction it finds with
//     outbox.MustTx(msg.Context()) (or outbox.TxFromContext);
//   - the messages the handler returns (or publishes on an outbox.Writer.ContextPublisher
//     event bus), written to the outbox instead of being published by the router.
//
// The transaction commits before the middleware returns, so the subscriber acknowledges (and
// commits the broker offset) only after the effect is durable. A handler error or panic rolls
// everything back, leaving no dedup row, so the redelivery runs the handler again.
//
// Use it as the innermost middleware, under Retry so each attempt gets a fresh transaction:
//
//	ib, err := inbox.New(inbox.Config{Pool: pool, Consumer: "billing"})
//	router.AddMiddleware(ib.Poison, retry.Middleware, middleware.Recoverer, ib.Middleware)
//	router.AddPlugin(ib.RouterPlugin) // applies replays of given-up messages (ReplayTx)
//	router.AddHandler("billing", "orders.placed", sub, "billing.invoiced", inbox.OutboxOnly{},
//		func(msg *message.Message) ([]*message.Message, error) {
//			tx := outbox.MustTx(msg.Context())
//			// ... writes on tx ...
//			return []*message.Message{outbox.NewMessage(invoice)}, nil
//		})
//
// The middleware is a thin wrapper over the transaction-first core, ClaimTx and SeenTx, which
// a consumer that is not a Watermill handler (a batch consumer, the saga orchestrator) calls
// in its own transaction.
//
// See docs/inbox.md for the recommended middleware order, the Kafka subscriber settings
// (package inbox/inboxkafka), retention (Cleaner) and the Redis store for effects outside
// PostgreSQL (package inbox/redisdedup).
package inbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"
	"weak"

	"github.com/onceflow/onceflow/internal/config"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/tracing"
	"github.com/onceflow/onceflow/outbox"
)

// MaxConsumerBytes bounds Config.Consumer, which is stored in every dedup row.
const MaxConsumerBytes = 200

// rollbackTimeout bounds a rollback. It runs on a context detached from the message's, so a
// cancelled or timed-out message still releases its connection cleanly.
const rollbackTimeout = 10 * time.Second

// DefaultCommitTimeout is the default Config.CommitTimeout.
const DefaultCommitTimeout = 30 * time.Second

// Config configures an Inbox. Pool and Consumer are required; every other field has a default.
type Config struct {
	// Pool opens one transaction per message. Required. Each message in flight holds one of
	// its connections, and the inbox always leaves one free for handlers that also use Pool
	// (pool.QueryRow, a pool.Begin of their own), so that they cannot wait forever for a
	// connection while every message holds one: at most MaxConns − 1 messages run at once
	// across every Inbox on the pool, and a pool of one connection is refused. Size it for
	// the messages handled at once (with watermill-kafka: one per assigned partition) plus
	// one; see docs/inbox.md, "Pool sizing".
	Pool *pgxpool.Pool
	// Schema holds processed_event (and the outbox, unless Writer says otherwise).
	// Default "onceflow". Must be a plain lower-case identifier.
	Schema string
	// Consumer names this consumer in the dedup rows: the same key under two consumers is two
	// messages, so two handlers of one topic each apply it once. Required. Keep it stable: a
	// renamed consumer sees every retained message as new.
	Consumer string
	// KeyFunc returns a message's dedup key. Default DefaultKey (saga id + step + phase for
	// saga messages, the event id otherwise).
	KeyFunc KeyFunc
	// Writer writes the messages the handler returns into the outbox, in the message's
	// transaction. Default: outbox.NewWriter(outbox.Config{Schema: Schema}).
	Writer *outbox.Writer
	// NoKeyPolicy decides what happens to a message without a usable key. Default RejectNoKey.
	NoKeyPolicy NoKeyPolicy
	// Logger receives duplicates (debug), dropped messages (warn) and rollback failures.
	// Default slog.Default().
	Logger *slog.Logger
	// Metrics counts processed, duplicate, failed and keyless messages. Default NopMetrics{}.
	Metrics Metrics
	// CommitTimeout bounds what follows a successful handler: writing the messages it returned
	// and the commit. Both run on a context detached from the message's cancellation (and
	// deadline), because watermill-kafka cancels the message's context when the subscriber
	// closes or the partition is revoked, and middleware.Timeout when its time is up: work
	// that succeeded should commit, not be thrown away and redone after the redelivery.
	// Default DefaultCommitTimeout (30 s); negative is refused.
	CommitTimeout time.Duration
	// TracerProvider records a `process <topic>` span (CONSUMER) per message, around its
	// transaction, whose parent is the message's creation context (docs/operations.md,
	// "Tracing"). Default nil: the global provider. Propagator reads that context from the
	// metadata (Kafka headers); default nil: the global propagator, or W3C trace context when
	// none is installed. Both also go to the default Writer.
	TracerProvider trace.TracerProvider
	Propagator     propagation.TextMapPropagator
	// TraceAttributes adds attributes to the `process` span, e.g. inboxkafka.TraceAttributes
	// (partition, offset, key). Default none.
	TraceAttributes TraceAttributesFunc
	// ReplayInterval is how often this consumer's processes look for replay requests of its
	// poison rows (`onceflow inbox poison replay`, ReplayTx): the router's (RouterPlugin) and
	// a batched consumer's (inboxkafka.BatchConsumer). Each look is one indexed query on the
	// rows waiting. Default DefaultReplayInterval (5 s); negative is refused.
	ReplayInterval time.Duration
}

// DefaultReplayInterval is the default Config.ReplayInterval.
const DefaultReplayInterval = 5 * time.Second

// Inbox is the deduplicating middleware of one consumer. It is safe for concurrent use; the
// router runs it for many messages at once.
type Inbox struct {
	cfg                                Config
	slots                              *connSlots // of cfg.Pool, shared with other Inboxes on it
	claimOneSQL, claimManySQL, seenSQL string
	seenManySQL, poisonSQL             string
	errManaged                         error // what Commit and Rollback on the handler's view return
	tr                                 *tracing.Tracer
	replaySQL                          replaySQL
	// routerReplays: RouterPlugin was installed, so the Poison middleware's rows get replayed.
	routerReplays  atomic.Bool
	warnNoReplayer sync.Once
}

// New validates cfg, reporting every problem at once, and returns an Inbox.
func New(cfg Config) (*Inbox, error) {
	if cfg.Schema == "" {
		cfg.Schema = pgsql.DefaultSchema
	}
	var problems []error
	var maxConns int32
	if cfg.Pool == nil {
		problems = append(problems, errors.New("Pool is nil; pass the *pgxpool.Pool of the database holding processed_event"))
	} else if maxConns = cfg.Pool.Config().MaxConns; maxConns < 2 {
		problems = append(problems, fmt.Errorf("Pool's MaxConns is %d; the inbox holds one connection per message in flight and keeps one free "+
			"for handlers that use the pool themselves (else they could wait for a connection forever): set pool_max_conns (or MaxConns) to at least 2", maxConns))
	}
	if err := pgsql.ValidateSchema(cfg.Schema); err != nil {
		problems = append(problems, err)
	}
	if err := validateConsumer(cfg.Consumer); err != nil {
		problems = append(problems, err)
	}
	if cfg.CommitTimeout < 0 {
		problems = append(problems, fmt.Errorf("CommitTimeout is %s; use 0 for the default (%s) or a positive bound", cfg.CommitTimeout, DefaultCommitTimeout))
	} else if cfg.CommitTimeout == 0 {
		cfg.CommitTimeout = DefaultCommitTimeout
	}
	if cfg.ReplayInterval < 0 {
		problems = append(problems, fmt.Errorf("ReplayInterval is %s; use 0 for the default (%s) or a positive interval", cfg.ReplayInterval, DefaultReplayInterval))
	} else if cfg.ReplayInterval == 0 {
		cfg.ReplayInterval = DefaultReplayInterval
	}
	if cfg.NoKeyPolicy != RejectNoKey && cfg.NoKeyPolicy != DropNoKey {
		problems = append(problems, fmt.Errorf("NoKeyPolicy is %v; use inbox.RejectNoKey (default) or inbox.DropNoKey", cfg.NoKeyPolicy))
	}
	if cfg.Writer == nil && len(problems) == 0 {
		w, err := outbox.NewWriter(outbox.Config{Schema: cfg.Schema, TracerProvider: cfg.TracerProvider, Propagator: cfg.Propagator})
		if err != nil {
			problems = append(problems, err)
		}
		cfg.Writer = w
	}
	if err := config.Check("inbox", problems...); err != nil {
		return nil, err
	}
	if cfg.KeyFunc == nil {
		cfg.KeyFunc = DefaultKey
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NopMetrics{}
	}
	cfg.Logger = cfg.Logger.With("consumer", cfg.Consumer)
	table := pgsql.Table(cfg.Schema, "processed_event")
	return &Inbox{
		cfg:   cfg,
		slots: slotsOf(cfg.Pool, maxConns),
		// ON CONFLICT DO NOTHING rather than catching a unique violation: an error would abort
		// the transaction, and a concurrent delivery of the same key waits here on the first
		// one's uncommitted row, then sees it (0 rows: skip) or inserts if the first rolled back.
		claimOneSQL:  `INSERT INTO ` + table + ` (consumer, dedup_key) VALUES ($1, $2) ON CONFLICT DO NOTHING`,
		claimManySQL: `INSERT INTO ` + table + ` (consumer, dedup_key) SELECT $1, k FROM unnest($2::text[]) AS u(k) ON CONFLICT DO NOTHING RETURNING dedup_key`,
		seenSQL:      `SELECT EXISTS (SELECT 1 FROM ` + table + ` WHERE consumer = $1 AND dedup_key = $2)`,
		// One index probe per key, whatever the table's statistics: `dedup_key = ANY($2)` lets
		// a generic plan made while the table was small (pgx prepares each statement once per
		// connection) scan every row of the consumer for each lookup, until the next ANALYZE.
		seenManySQL: `SELECT u.k FROM unnest($2::text[]) AS u(k) CROSS JOIN LATERAL (SELECT 1 FROM ` + table +
			` WHERE consumer = $1 AND dedup_key = u.k LIMIT 1) AS hit`,
		poisonSQL: `INSERT INTO ` + pgsql.Table(cfg.Schema, "inbox_poison") +
			` (consumer, dedup_key, message_uuid, source, metadata, payload, attempts, error, handler, publish_topic, replay_refusal)` +
			` VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)`,
		errManaged: fmt.Errorf("%w (inbox consumer %q: it commits after writing the handler's returned messages; to abort, return an error from the handler)",
			outbox.ErrTxManaged, cfg.Consumer),
		tr:        tracing.New(cfg.TracerProvider, cfg.Propagator),
		replaySQL: newReplaySQL(cfg.Schema),
	}, nil
}

func validateConsumer(c string) error {
	switch {
	case c == "":
		return errors.New(`Consumer is empty; name the consumer (e.g. "billing"): it is part of every dedup key and must stay stable`)
	case len(c) > MaxConsumerBytes:
		return fmt.Errorf("Consumer is %d bytes; use at most %d", len(c), MaxConsumerBytes)
	case !utf8.ValidString(c) || strings.IndexByte(c, 0) >= 0:
		return fmt.Errorf("Consumer %q is not valid UTF-8 text without NUL bytes", c)
	}
	return nil
}

// Config returns the configuration with defaults filled in.
func (ib *Inbox) Config() Config { return ib.cfg }

// Middleware is the message.HandlerMiddleware. Install it innermost (closest to the handler)
// so that each Retry attempt runs in its own transaction; see the package documentation.
func (ib *Inbox) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		return ib.handle(msg, h)
	}
}

// handle is the batch engine (processBatch) with a batch of one: the message's dedup row,
// the handler's writes and the messages it returns commit in one transaction. The handler's
// own error is returned unwrapped, so errors.Is/As and poison-queue reasons see it, and its
// panic keeps unwinding (after the rollback) to Recoverer or the router.
func (ib *Inbox) handle(msg *message.Message, h message.HandlerFunc) ([]*message.Message, error) {
	if n, ok := msg.Context().Value(attemptsKey{}).(*atomic.Int32); ok {
		n.Add(1) // an attempt, for the Poison middleware's record
	}
	err := ib.processBatch(msg.Context(), []*message.Message{msg}, message.PublishTopicFromCtx(msg.Context()), h, nil, nil)
	if pe := (*panicError)(nil); errors.As(err, &pe) {
		panic(pe.v) // rolled back already; keeps unwinding to Recoverer or the router
	}
	if me := (*MessageError)(nil); errors.As(err, &me) {
		return nil, me.Err
	}
	// Nothing goes back to the router: the produced messages are in the outbox.
	return nil, err
}

func (ib *Inbox) key(msg *message.Message) (string, error) {
	key, err := ib.cfg.KeyFunc(msg)
	if err != nil {
		if !errors.Is(err, ErrNoKey) {
			err = fmt.Errorf("%w: KeyFunc: %w", ErrNoKey, err)
		}
		return "", err
	}
	return checkKey(key)
}

func (ib *Inbox) rollback(ctx context.Context, tx pgx.Tx, msg *message.Message) {
	// Always call Rollback, even on a broken connection: it also returns the connection to
	// the pool.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	closed := tx.Conn() != nil && tx.Conn().IsClosed()
	// pgx closes the connection when a query's context is cancelled (Timeout middleware); the
	// server aborted the transaction with it, so a failed rollback there is expected.
	if err := tx.Rollback(ctx); err != nil && !errors.Is(err, pgx.ErrTxClosed) && !closed {
		// The server aborts the transaction when the connection closes, so nothing is kept.
		uuid := "" // nil for a batch
		if msg != nil {
			uuid = msg.UUID
		}
		ib.cfg.Logger.Warn("inbox: rollback failed; the connection is discarded and the server aborts the transaction",
			"message_uuid", uuid, "err", err)
	}
}

// ErrNoTopic is returned when a handler returns a message the inbox cannot address: the
// handler was registered without a publish topic and the message was not given one with
// outbox.ToTopic.
var ErrNoTopic = errors.New("the handler returned a message but no topic is known for it: " +
	"register the handler with a publish topic (router.AddHandler(name, subscribeTopic, sub, publishTopic, inbox.OutboxOnly{}, h)) " +
	"or address the message with outbox.ToTopic(msg, topic)")

// IsPoison reports whether err is an inbox error that retrying the same message cannot fix,
// so the message belongs in a poison queue: a message without a usable key (ErrNoKey), a
// returned message without a topic (ErrNoTopic) or one the outbox refuses
// (*outbox.ValidationError).
func IsPoison(err error) bool {
	var ve *outbox.ValidationError
	return errors.Is(err, ErrNoKey) || errors.Is(err, ErrNoTopic) || errors.As(err, &ve)
}

// ShouldRetry is a middleware.Retry ShouldRetry function that stops retrying poison messages
// (IsPoison), so they reach the poison queue at once:
//
//	middleware.Retry{MaxRetries: 5, ..., ShouldRetry: inbox.ShouldRetry}
func ShouldRetry(p middleware.RetryParams) bool { return !IsPoison(p.Err) }

// writeProduced writes the handler's messages to the outbox in tx, in the order returned, in
// one statement whatever their topics: each goes to its outbox.ToTopic topic, or else to
// defaultTopic (the handler's publish topic).
func (ib *Inbox) writeProduced(ctx context.Context, tx pgx.Tx, defaultTopic string, produced []*message.Message) error {
	// Refusals are *outbox.ValidationErrors with the message's index, as the outbox's own:
	// a batched consumer maps the index to the handler that returned the message.
	for i, m := range produced {
		if m == nil {
			return fmt.Errorf("inbox: consumer %q: %w", ib.cfg.Consumer,
				&outbox.ValidationError{Index: i, Err: errors.New("the handler returned a nil message")})
		}
		if outbox.TopicOf(m, defaultTopic) == "" {
			return fmt.Errorf("inbox: consumer %q: message %d (uuid %q): %w", ib.cfg.Consumer, i, m.UUID,
				&outbox.ValidationError{Index: i, UUID: m.UUID, Err: ErrNoTopic})
		}
	}
	if err := ib.cfg.Writer.WriteTx(ctx, tx, defaultTopic, produced...); err != nil {
		return fmt.Errorf("inbox: consumer %q: write the handler's messages to the outbox: %w", ib.cfg.Consumer, err)
	}
	return nil
}

// ErrRouterPublish is returned by OutboxOnly when messages reach the router's publisher,
// which means the inbox middleware is not installed on that handler.
var ErrRouterPublish = errors.New("inbox: a handler's messages reached the router's publisher, so the inbox middleware is not installed on it: " +
	"add it (router.AddMiddleware(ib.Middleware) or handler.AddMiddleware(ib.Middleware)) so they are written to the outbox in the handler's transaction")

// OutboxOnly is the publisher to register inbox handlers with. The inbox writes the
// handler's messages to the outbox and returns none to the router, so this publisher never
// receives any; if it does, the middleware is missing and it refuses with ErrRouterPublish
// rather than publish outside the transaction.
//
//	router.AddHandler("billing", "orders.placed", sub, "billing.invoiced", inbox.OutboxOnly{}, handle)
type OutboxOnly struct{}

// Publish implements message.Publisher by refusing; see OutboxOnly.
func (OutboxOnly) Publish(string, ...*message.Message) error { return ErrRouterPublish }

// Close implements message.Publisher.
func (OutboxOnly) Close() error { return nil }

// connSlots bounds the messages that hold a connection of one pool for their transaction, to
// the pool's MaxConns − 1, across every Inbox on that pool. The connection left over is what
// makes a handler that takes one more connection from the same pool safe: without it, a full
// set of messages in flight would each hold a connection and wait for another, forever.
type connSlots struct {
	ch      chan struct{}
	waiting atomic.Int64 // messages waiting for a slot, for tests
}

// acquire takes a slot, waiting while every slot is taken, until ctx ends.
func (s *connSlots) acquire(ctx context.Context) error {
	select {
	case s.ch <- struct{}{}:
		return nil
	default:
	}
	s.waiting.Add(1)
	defer s.waiting.Add(-1)
	select {
	case s.ch <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (s *connSlots) release() { <-s.ch }

// poolSlots holds the slots of each pool an Inbox was built on. The pools are held weakly:
// a pool that is no longer referenced takes its entry with it.
var poolSlots = struct {
	sync.Mutex
	m map[weak.Pointer[pgxpool.Pool]]*connSlots
}{m: map[weak.Pointer[pgxpool.Pool]]*connSlots{}}

// slotsOf returns the slots shared by every Inbox on pool, for a pool of maxConns ≥ 2.
func slotsOf(pool *pgxpool.Pool, maxConns int32) *connSlots {
	key := weak.Make(pool)
	poolSlots.Lock()
	defer poolSlots.Unlock()
	if s := poolSlots.m[key]; s != nil {
		return s
	}
	s := &connSlots{ch: make(chan struct{}, maxConns-1)}
	poolSlots.m[key] = s
	runtime.AddCleanup(pool, func(key weak.Pointer[pgxpool.Pool]) {
		poolSlots.Lock()
		delete(poolSlots.m, key)
		poolSlots.Unlock()
	}, key)
	return s
}
