package relay

import (
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/internal/config"
	"github.com/onceflow/onceflow/internal/pgsql"
)

// Defaults used when a Config field is left zero.
const (
	DefaultBatchSize     = 1000
	DefaultMaxBatchBytes = 64 << 20
	DefaultPollInterval  = time.Second
	// DefaultScheduledCheckInterval is Config.ScheduledCheckInterval's default.
	DefaultScheduledCheckInterval = 500 * time.Millisecond
	DefaultBusyPoll               = time.Millisecond
	DefaultShards                 = 64
	DefaultLeaseDuration          = 8 * time.Second
	DefaultMaxAttempts            = 10
	DefaultRetryBackoff           = 100 * time.Millisecond
	DefaultMaxRetryBackoff        = 30 * time.Second
	DefaultShutdownTimeout        = 10 * time.Second
	// DefaultStatementTimeout bounds each of the relay's claims, deletes and failure records.
	DefaultStatementTimeout = 15 * time.Second
	DefaultStatsInterval    = 10 * time.Second
	// DefaultFailureLogInterval is how often a relay that keeps failing to publish logs a summary.
	DefaultFailureLogInterval = 30 * time.Second
)

// Limits enforced by Config validation.
const (
	MaxShards    = 1 << 16
	MaxBatchSize = 100_000
	// MinLeaseDuration keeps renewals (every LeaseDuration/4) from turning into a busy loop.
	MinLeaseDuration = 400 * time.Millisecond
	// MinPollInterval keeps an idle relay from hammering the database.
	MinPollInterval = 5 * time.Millisecond
	// MinBusyPoll keeps a busy relay from claiming in a tight loop.
	MinBusyPoll = 100 * time.Microsecond
	// MinBatchBytes is the smallest byte budget accepted.
	MinBatchBytes = 1 << 10
	maxInstanceID = 200
)

// Config configures a Relay. Pool and Sink are required; every other field has a documented
// default. New reports every invalid field at once.
type Config struct {
	// Pool reaches the database holding the migrated schema. Required. The relay also opens one
	// extra connection of its own (with the pool's settings, or ListenConnConfig) for LISTEN.
	// Pool may go through PgBouncer in transaction mode; give its ConnConfig a
	// DefaultQueryExecMode that pooler supports (docs/relay.md, "Connection poolers").
	Pool *pgxpool.Pool

	// ListenConnConfig is the connection the relay LISTENs on for writers' notifications.
	// Default nil: a copy of Pool's. Set it (from pgx.ParseConfig) when Pool goes through a
	// pooler in transaction or statement mode (PgBouncer's pool_mode = transaction): there a
	// LISTEN holds for one statement only, the pooler hands the listening server connection to
	// other clients and no notification reaches the relay. Point it at the primary directly
	// or at a session-mode pool; it costs one server connection per relay. The relay checks
	// every listener connection once (a NOTIFY sent through Pool must arrive) and, when it
	// does not, logs a warning that says so and polls instead (see DisableListen).
	ListenConnConfig *pgx.ConnConfig
	// Sink publishes the claimed rows. Required: relaykafka.NewSink for Kafka, or
	// NewPublisherSink for any Watermill publisher.
	Sink Sink

	// Schema holds the outbox and relay tables. Default "onceflow".
	Schema string

	// BatchSize is the most rows claimed, and sent to the broker in one round trip, at a time.
	// Default 1000.
	BatchSize int

	// MaxBatchBytes bounds the bytes of one batch (payloads, keys, topics and metadata of the
	// rows claimed together), so the relay's memory is bounded by configuration, not by the
	// data: the claim stops adding rows once the next one would exceed it (a single row larger
	// than the budget is still claimed, alone). Peak memory is about twice this plus a few tens
	// of MiB (the Go heap keeps garbage up to its live size, see GOGC). Default 64 MiB.
	MaxBatchBytes int64

	// PollInterval is the longest an idle relay waits before looking for rows when no
	// notification arrived. An idle relay sleeps: it marks itself asleep in relay_member, and
	// writers then send a NOTIFY on commit, which wakes it at once; the poll covers lost
	// notifications and writers with notify disabled. Default 1s (an idle relay costs about one
	// claim per PollInterval plus one lease round trip per LeaseDuration/4).
	PollInterval time.Duration

	// BusyPollInterval is how often the relay claims while rows keep arriving and its last
	// batch was not full (a full batch is followed by the next claim at once). It bounds the
	// delay rows wait under load without any notification, and lets batches grow with the
	// traffic instead of costing a claim, a produce and a delete per event. After 25ms without
	// rows the relay goes to sleep (see PollInterval). Default 1ms.
	BusyPollInterval time.Duration

	// ScheduledCheckInterval is the longest an awake relay waits before looking up the next due
	// time of the scheduled messages (outbox.DeliverAt, outbox.DeliverAfter): writers do not
	// notify an awake relay, so a message written due sooner than the relay's next known due
	// time is found within this interval. Between checks the relay waits until the next due
	// time, then moves the due rows into the outbox and publishes them; a check is one index
	// lookup, whatever the number of scheduled rows. A sleeping relay checks every
	// outbox.ScheduledWakeWithin minus this interval instead: writes of messages due sooner
	// wake it (see outbox.ScheduledWakeWithin). Default 500ms, which with the move and the
	// publish keeps a message's delay after its due time under 1s.
	ScheduledCheckInterval time.Duration

	// Shards is the number of virtual shards rows are spread over (key_hash % Shards). Each
	// shard is published by one relay at a time. Every relay of a schema must use the same
	// number: New's relay refuses to start when the lease table holds a different one (see
	// Reshard). Default 64; more shards than relays lets the work spread evenly.
	Shards int

	// LeaseDuration is how long a shard lease lasts without renewal. Relays renew every
	// LeaseDuration/4 and stop publishing a shard once their last successful renewal (timed
	// from when it was sent) is older than LeaseDuration minus LeaseDuration/4, so they stop
	// before the lease can expire in the database. A dead relay's shards are taken over at most
	// LeaseDuration + LeaseDuration/4 after its last renewal. Default 8s: failover ≤ 10s.
	LeaseDuration time.Duration

	// MaxAttempts is how many times a row may be refused by the broker with an undeliverable
	// error (IsUndeliverable: message too large, invalid record, ...) before it is parked in
	// outbox_parked so the rows behind it can flow. Transient errors (broker down, timeouts)
	// never count. Default 10.
	MaxAttempts int

	// RetryBackoff is the first wait after a failed publish; each further failure doubles it up
	// to MaxRetryBackoff, with ±25% jitter. Defaults 100ms and 30s.
	RetryBackoff    time.Duration
	MaxRetryBackoff time.Duration

	// StatementTimeout bounds every claim, delete and failure record the relay sends (lease
	// renewals are bounded by LeaseDuration). A statement still running then is cancelled and
	// its connection closed if it does not answer, so a claim stuck on a half-open connection
	// (a NAT or firewall that dropped the flow silently) or behind a lock is retried on a fresh
	// connection instead of stalling this relay's shards while its renewals, on other
	// connections, keep them. Default 15s; raise it only if a first claim after failover,
	// which walks the outbox once, legitimately takes longer.
	StatementTimeout time.Duration

	// ShutdownTimeout is how long Run waits, once its context is cancelled, for the batch in
	// flight to be acknowledged before abandoning it (its rows stay and are published again
	// later, with the same event ids). Default 10s.
	ShutdownTimeout time.Duration

	// StatsInterval is how often the relay samples the number of pending rows and the age of
	// the oldest for Metrics.Pending. Default 10s; negative disables sampling.
	StatsInterval time.Duration

	// FailureLogInterval is how often a relay that keeps failing to publish logs one warning
	// summing the failures up: how many, per topic and error, how many rows are undeliverable,
	// how many keys wait, and the age of the oldest failing row. The first failure after a
	// quiet spell is logged at once and the recovery too; single failures go to debug. Default
	// 30s.
	FailureLogInterval time.Duration

	// InstanceID names this relay in the lease table. It must be unique among running relays.
	// A relay restarted with the same id takes over its own leases at once instead of waiting
	// for them to expire. Default "<hostname>-<pid>".
	InstanceID string

	// DisableListen turns off LISTEN/NOTIFY; the relay then finds rows by polling only (every
	// BusyPollInterval while rows arrive, backing off to PollInterval when idle), and never asks
	// writers to notify it. The choice behind a transaction-mode pooler when no direct or
	// session-mode connection is available for ListenConnConfig: idle latency up to
	// PollInterval, no listener connection and no start-up check.
	DisableListen bool

	// Logger receives the relay's logs. Default: slog.Default().
	Logger *slog.Logger

	// Metrics receives the relay's measurements. Default: none (see relay/relayprom).
	Metrics Metrics

	// TracerProvider records one `send <topic>` span per batch handed to the sink, linked to
	// each message's `create` span (docs/operations.md, "Tracing"). Default nil: the global
	// provider. Propagator reads the creation context from the metadata; default nil: the
	// global propagator, or W3C trace context when none is installed.
	TracerProvider trace.TracerProvider
	Propagator     propagation.TextMapPropagator
}

// Validate reports every invalid field at once, as New would, without needing a pool or sink.
func (c Config) Validate() error {
	_, err := c.withDefaults()
	return err
}

// renewInterval is how often leases are renewed and membership refreshed.
func (c Config) renewInterval() time.Duration { return c.LeaseDuration / 4 }

// fenceMargin is how long before the database expiry a relay stops publishing a shard.
func (c Config) fenceMargin() time.Duration { return c.LeaseDuration / 4 }

// FailoverBound is the longest a shard of a relay that died stays unpublished: its lease
// expires LeaseDuration after its last renewal and the other relays look every
// LeaseDuration/4.
func (c Config) FailoverBound() time.Duration {
	c, _ = c.withDefaults()
	return c.LeaseDuration + c.renewInterval()
}

// withDefaults fills zero fields and validates the result, reporting every problem.
func (c Config) withDefaults() (Config, error) {
	if c.Schema == "" {
		c.Schema = pgsql.DefaultSchema
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.MaxBatchBytes == 0 {
		c.MaxBatchBytes = DefaultMaxBatchBytes
	}
	if c.PollInterval == 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.ScheduledCheckInterval == 0 {
		c.ScheduledCheckInterval = DefaultScheduledCheckInterval
	}
	if c.BusyPollInterval == 0 {
		c.BusyPollInterval = DefaultBusyPoll
	}
	if c.Shards == 0 {
		c.Shards = DefaultShards
	}
	if c.LeaseDuration == 0 {
		c.LeaseDuration = DefaultLeaseDuration
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultMaxAttempts
	}
	if c.RetryBackoff == 0 {
		c.RetryBackoff = DefaultRetryBackoff
	}
	if c.MaxRetryBackoff == 0 {
		c.MaxRetryBackoff = DefaultMaxRetryBackoff
	}
	if c.StatementTimeout == 0 {
		c.StatementTimeout = DefaultStatementTimeout
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = DefaultShutdownTimeout
	}
	if c.FailureLogInterval == 0 {
		c.FailureLogInterval = DefaultFailureLogInterval
	}
	if c.StatsInterval == 0 {
		c.StatsInterval = DefaultStatsInterval
	}
	if c.InstanceID == "" {
		c.InstanceID = defaultInstanceID()
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Metrics == nil {
		c.Metrics = NopMetrics{}
	}

	var problems []error
	add := func(format string, args ...any) { problems = append(problems, fmt.Errorf(format, args...)) }
	if err := pgsql.ValidateSchema(c.Schema); err != nil {
		problems = append(problems, err)
	}
	if c.FailureLogInterval < 0 {
		add("FailureLogInterval is %s; use a positive duration (0 means the default %s)", c.FailureLogInterval, DefaultFailureLogInterval)
	}
	if c.BatchSize < 1 || c.BatchSize > MaxBatchSize {
		add("BatchSize is %d; use 1 to %d (0 means the default %d)", c.BatchSize, MaxBatchSize, DefaultBatchSize)
	}
	if c.MaxBatchBytes < MinBatchBytes {
		add("MaxBatchBytes is %d; use at least %d (0 means the default %d)", c.MaxBatchBytes, MinBatchBytes, DefaultMaxBatchBytes)
	}
	if c.ScheduledCheckInterval < MinPollInterval {
		add("ScheduledCheckInterval is %s; use at least %s (0 means the default %s)", c.ScheduledCheckInterval, MinPollInterval, DefaultScheduledCheckInterval)
	}
	if c.PollInterval < MinPollInterval {
		add("PollInterval is %s; use at least %s (0 means the default %s)", c.PollInterval, MinPollInterval, DefaultPollInterval)
	}
	if c.BusyPollInterval < MinBusyPoll || (c.PollInterval >= MinPollInterval && c.BusyPollInterval > c.PollInterval) {
		add("BusyPollInterval is %s; use %s to PollInterval (%s) (0 means the default %s)", c.BusyPollInterval, MinBusyPoll, c.PollInterval, DefaultBusyPoll)
	}
	if c.Shards < 1 || c.Shards > MaxShards {
		add("Shards is %d; use 1 to %d (0 means the default %d)", c.Shards, MaxShards, DefaultShards)
	}
	if c.LeaseDuration < MinLeaseDuration {
		add("LeaseDuration is %s; use at least %s (0 means the default %s)", c.LeaseDuration, MinLeaseDuration, DefaultLeaseDuration)
	}
	if c.MaxAttempts < 1 {
		add("MaxAttempts is %d; use 1 or more (0 means the default %d)", c.MaxAttempts, DefaultMaxAttempts)
	}
	if c.RetryBackoff < 0 {
		add("RetryBackoff is %s; use a positive duration (0 means the default %s)", c.RetryBackoff, DefaultRetryBackoff)
	}
	if c.MaxRetryBackoff < c.RetryBackoff {
		add("MaxRetryBackoff (%s) is shorter than RetryBackoff (%s)", c.MaxRetryBackoff, c.RetryBackoff)
	}
	if c.StatementTimeout < 10*time.Millisecond {
		add("StatementTimeout is %s; use at least 10ms (0 means the default %s)", c.StatementTimeout, DefaultStatementTimeout)
	}
	if c.ShutdownTimeout < 0 {
		add("ShutdownTimeout is %s; use a positive duration (0 means the default %s)", c.ShutdownTimeout, DefaultShutdownTimeout)
	}
	if len(c.InstanceID) > maxInstanceID {
		add("InstanceID is %d bytes long; use at most %d", len(c.InstanceID), maxInstanceID)
	}
	if len(problems) > 0 {
		return c, &ConfigError{Scope: "relay", Problems: problems}
	}
	return c, nil
}

// ConfigError is returned by New (and relaykafka.NewSink) for an invalid config. It lists
// every problem at once: Scope names what was configured and Problems holds one error per
// problem, each saying what to change; Error() puts them on one line. It is the same type in
// every onceflow package (outbox, inbox, idempotency, relay), so errors.As with any of them
// matches.
type ConfigError = config.Error

func defaultInstanceID() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "relay"
	}
	return host + "-" + strconv.Itoa(os.Getpid())
}
