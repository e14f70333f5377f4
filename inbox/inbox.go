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
//	router.AddPlugin(ib.RouterPlugin) // applies replays of given-up messages (Admin.ReplayTx)
//	router.AddHandler("billing", "orders.placed", sub, "billing.invoiced", inbox.OutboxOnly{},
//		func(msg *message.Message) ([]*message.Message, error) {
//			tx := outbox.MustTx(msg.Context())
//			// ... writes on tx ...
//			return []*message.Message{outbox.NewMessage(invoice)}, nil
//		})
//
// Whose a failure is decides what happens next, by one rule shared by every consumer (the
// table is in docs/inbox.md, "Whose failure is it"). A failure of the transaction's own
// connection or server — a deadlock, a lock or statement timeout, the connection lost, the
// server restarting (pgconn's errors, a SQLSTATE, the transaction's connection found closed) —
// is the transaction's: it is retried and never given up. Everything else the handler returns
// is the message's, also what merely looks like a network error: an http.Client's *url.Error,
// a deadline of middleware.Timeout, a json.Decoder's io.EOF on an empty payload. Poison gives
// such a message up after its attempts.
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
	"sync"
	"sync/atomic"
	"time"

	"github.com/onceflow/onceflow/internal/config"
	"github.com/onceflow/onceflow/internal/engine"

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
const MaxConsumerBytes = engine.MaxConsumerBytes

// DefaultCommitTimeout is the default Config.CommitTimeout, and that of every onceflow
// consumer (the saga orchestrator's and participants' too).
const DefaultCommitTimeout = engine.DefaultCommitTimeout

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
	// poison rows (`onceflow inbox poison replay`, Admin.ReplayTx): the router's (RouterPlugin) and
	// a batched consumer's (inboxkafka.BatchConsumer). Each look is one indexed query on the
	// rows waiting. Default DefaultReplayInterval (5 s); negative is refused.
	ReplayInterval time.Duration
	// LaneKey returns a message's key in the retry lane (RetryAfter): a message parked for
	// later holds back the later messages of its key (of its topic, for this consumer), and
	// only those. Default: outbox.PartitionKey, the key the relay published it with, else, on
	// a batched consumer, the record's Kafka key. Return "" for a message without one: it is
	// parked alone and holds nothing back. On a router, for messages other producers sent,
	// watermill-kafka's kafka.MessageKeyFromCtx gives the Kafka key.
	LaneKey func(*message.Message) string
	// LaneMaxAttempts is how many failed attempts a message in the retry lane may reach before
	// it is given up as poison (its key's later messages then go on). Default
	// DefaultLaneMaxAttempts; negative is refused.
	LaneMaxAttempts int
	// LaneInterval is how often this consumer's processes look for parked messages that are
	// due (Inbox.RouterPlugin, inboxkafka.BatchConsumer): one indexed query. A message is
	// applied about this long after its time at most. Default DefaultLaneInterval (1 s);
	// negative is refused.
	LaneInterval time.Duration
}

// DefaultReplayInterval is the default Config.ReplayInterval.
const DefaultReplayInterval = 5 * time.Second

// Inbox is the deduplicating middleware of one consumer. It is safe for concurrent use; the
// router runs it for many messages at once.
type Inbox struct {
	cfg Config
	// run runs the transactions (internal/engine): the pool's connection slots, shared with
	// every consumer on it, the dedup statements, the commit timeout.
	run        *engine.Runner
	errManaged error // what Commit and Rollback on the handler's view return
	tr         *tracing.Tracer
	replaySQL  replaySQL
	laneSQL    laneSQL
	// routerReplays: RouterPlugin was installed, so the Poison middleware's rows get replayed.
	routerReplays  atomic.Bool
	warnNoReplayer sync.Once
	warnNoPoison   sync.Once
}

// New validates cfg, reporting every problem at once, and returns an Inbox.
func New(cfg Config) (*Inbox, error) {
	if cfg.Schema == "" {
		cfg.Schema = pgsql.DefaultSchema
	}
	var problems []error
	if cfg.Pool == nil {
		problems = append(problems, errors.New("Pool is nil; pass the *pgxpool.Pool of the database holding processed_event"))
	}
	problems = append(problems, engine.Check(cfg.Pool, cfg.Schema, cfg.Consumer, cfg.CommitTimeout)...)
	if cfg.CommitTimeout == 0 {
		cfg.CommitTimeout = DefaultCommitTimeout
	}
	for _, err := range []error{
		config.Default("ReplayInterval", &cfg.ReplayInterval, DefaultReplayInterval),
		config.Default("LaneMaxAttempts", &cfg.LaneMaxAttempts, DefaultLaneMaxAttempts),
		config.Default("LaneInterval", &cfg.LaneInterval, DefaultLaneInterval),
	} {
		if err != nil {
			problems = append(problems, err)
		}
	}
	if cfg.LaneKey == nil {
		cfg.LaneKey = defaultLaneKey
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
	run := engine.New(engine.Config{Pool: cfg.Pool, Schema: cfg.Schema, Consumer: cfg.Consumer,
		What: fmt.Sprintf("inbox: consumer %q", cfg.Consumer), CommitTimeout: cfg.CommitTimeout, Logger: cfg.Logger})
	cfg.Logger = cfg.Logger.With("consumer", cfg.Consumer)
	return &Inbox{
		cfg: cfg,
		run: run,
		errManaged: fmt.Errorf("%w (inbox consumer %q: it commits after writing the handler's returned messages; to abort, return an error from the handler)",
			outbox.ErrTxManaged, cfg.Consumer),
		tr:        tracing.New(cfg.TracerProvider, cfg.Propagator),
		replaySQL: newReplaySQL(cfg.Schema),
		laneSQL:   newLaneSQL(cfg.Schema),
	}, nil
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

// handle is the engine's transaction with a batch of one: the message's dedup row, the
// handler's writes and the messages it returns commit together. The handler's own error is
// returned unwrapped, so errors.Is/As and poison-queue reasons see it, and its panic keeps
// unwinding (after the rollback) to Recoverer or the router. Whose each attempt's failure was
// goes to the Poison middleware outside (attempts).
func (ib *Inbox) handle(msg *message.Message, h message.HandlerFunc) ([]*message.Message, error) {
	pass, _ := msg.Context().Value(attemptsKey{}).(*attempts)
	err := ib.processBatch(msg.Context(), []*message.Message{msg}, message.PublishTopicFromCtx(msg.Context()), h, nil)
	me := (*MessageError)(nil)
	messages := errors.As(err, &me)
	// Not the message's while its context is live: the transaction's failure. A failure with the
	// context ended is the deadline's or the stop's; Poison tells those apart by its own context.
	pass.record(err != nil && !messages && msg.Context().Err() == nil)
	if pe := (*engine.PanicError)(nil); errors.As(err, &pe) {
		panic(pe.Value) // rolled back already; keeps unwinding to Recoverer or the router
	}
	if messages {
		if pass == nil && engine.AsRetryLater(me.Err) != nil {
			ib.warnNoPoison.Do(func() {
				ib.cfg.Logger.Warn("inbox: a handler returned RetryAfter but the Poison middleware is not installed, so nothing parks the message: " +
					"it fails as any error and is redelivered in place, holding up its partition; add router.AddMiddleware(ib.Poison, …) outermost and router.AddPlugin(ib.RouterPlugin)")
			})
		}
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
	return errors.Is(err, ErrNoTopic) || engine.Unfixable(err)
}

// ShouldRetry is a middleware.Retry ShouldRetry function that stops retrying poison messages
// (IsPoison), so they reach the poison queue at once:
//
//	middleware.Retry{MaxRetries: 5, ..., ShouldRetry: inbox.ShouldRetry}
//
// It does not retry a RetryAfter either: the Poison middleware parks it in the retry lane.
func ShouldRetry(p middleware.RetryParams) bool {
	return !IsPoison(p.Err) && engine.AsRetryLater(p.Err) == nil
}

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
