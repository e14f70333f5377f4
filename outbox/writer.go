// Package outbox writes domain events into the outbox table inside the caller's transaction,
// so an event exists if and only if its business transaction commits.
//
// The primary API is transaction-first:
//
//	tx, _ := pool.Begin(ctx)
//	// ... business writes on tx ...
//	err := outbox.WriteTx(ctx, tx, "orders", outbox.NewMessage(payload))
//	// ... tx.Commit(ctx)
//
// Code written against Watermill can use a message.Publisher instead: NewTxPublisher binds one
// to a transaction, and ContextPublisher finds the transaction in each message's context
// (ContextWithTx), which is what a cqrs.EventBus needs.
package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"

	"github.com/onceflow/onceflow/internal/config"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/tracing"
)

// DefaultMaxPayloadBytes is the default payload limit: 1 MiB, Kafka's default message size.
const DefaultMaxPayloadBytes = 1 << 20

// Validation errors, wrapped in a *ValidationError that names the message.
var (
	ErrEmptyTopic      = errors.New("topic is empty")
	ErrNilPayload      = errors.New("payload is nil (use []byte{} for an empty payload)")
	ErrPayloadTooLarge = errors.New("payload exceeds the configured limit")
	ErrInvalidUUID     = errors.New("message UUID is not a valid UUID (create messages with outbox.NewMessage)")
	ErrNoMessages      = errors.New("no messages to write")
)

// ValidationError reports which message of a write call was refused and why.
// When a call has any invalid message, none of its messages are written.
type ValidationError struct {
	Index int    // position of the message in the call
	UUID  string // the message's UUID as given
	Err   error  // one of the Err* sentinels, possibly wrapped with detail
}

func (e *ValidationError) Error() string {
	return fmt.Sprintf("outbox: message %d (uuid %q): %v", e.Index, e.UUID, e.Err)
}

func (e *ValidationError) Unwrap() error { return e.Err }

// Config configures a Writer. The zero value is valid and uses the defaults.
type Config struct {
	// Schema holds the outbox table. Default "onceflow".
	Schema string
	// MaxPayloadBytes refuses larger payloads. Default DefaultMaxPayloadBytes (1 MiB).
	MaxPayloadBytes int
	// DisableNotify skips the pg_notify wake-up. Default false: every write call sends one
	// notification on NotifyChannel(Schema), delivered by PostgreSQL only when the
	// transaction commits, so relays wake at once instead of at their next poll.
	DisableNotify bool
	// TracerProvider records a `create <topic>` span per message written (see docs/operations.md,
	// "Tracing"). Default nil: the global provider (otel.GetTracerProvider).
	TracerProvider trace.TracerProvider
	// Propagator writes the span context into the message metadata. Default nil: the global
	// propagator, or W3C trace context (traceparent/tracestate) when none is installed.
	Propagator propagation.TextMapPropagator
}

// NotifyChannel is the LISTEN/NOTIFY channel a write call signals on commit: the schema name
// followed by "_outbox" ("onceflow_outbox" by default), cut to 63 bytes, the longest channel
// name PostgreSQL accepts (pg_notify refuses longer ones, which would fail every write to a
// schema named with 57 bytes or more). Schemas sharing those 63 bytes share the channel; a
// relay woken for the other schema just finds nothing new. The payload is empty.
func NotifyChannel(schema string) string {
	const maxChannel = 63 // NAMEDATALEN - 1
	c := schema + "_outbox"
	if len(c) > maxChannel {
		c = c[:maxChannel] // schema names are ASCII (pgsql.ValidateSchema)
	}
	return c
}

// Writer inserts messages into the outbox. It is safe for concurrent use.
type Writer struct {
	cfg Config
	// insertSQL takes one topic for the whole call ($1 text), insertRoutedSQL one per message
	// ($1 text[]), for calls whose messages go to several topics (ToTopic).
	insertSQL, insertRoutedSQL string
	tracer                     *tracing.Tracer
}

// NewWriter validates cfg and returns a Writer.
func NewWriter(cfg Config) (*Writer, error) {
	if cfg.Schema == "" {
		cfg.Schema = pgsql.DefaultSchema
	}
	var problems []error
	if err := pgsql.ValidateSchema(cfg.Schema); err != nil {
		problems = append(problems, err)
	}
	if cfg.MaxPayloadBytes < 0 {
		problems = append(problems, fmt.Errorf("MaxPayloadBytes is %d; use 0 for the default (%d) or a positive limit", cfg.MaxPayloadBytes, DefaultMaxPayloadBytes))
	}
	if cfg.MaxPayloadBytes == 0 {
		cfg.MaxPayloadBytes = DefaultMaxPayloadBytes
	}
	if err := config.Check("outbox", problems...); err != nil {
		return nil, err
	}
	return &Writer{cfg: cfg, insertSQL: insertSQL(cfg, "$1"), insertRoutedSQL: insertSQL(cfg, "t"),
		tracer: tracing.New(cfg.TracerProvider, cfg.Propagator)}, nil
}

// insertSQL is the write statement. topic is "$1" for a call with one topic, or "t" to take
// each row's topic from the unnested $1 text[] array.
func insertSQL(cfg Config, topic string) string {
	topics := ""
	if topic == "t" {
		topics = "$1::text[], "
	}
	cols := topics + `$2::uuid[], $3::text[], $4::bigint[], $5::bytea[], $6::text[]`
	as := "e, k, h, p, m"
	if topic == "t" {
		as = "t, " + as
	}
	// One statement, one round trip: the arrays are unnested in order, so ids (the relay's claim
	// order) follow the order of the messages in the call. The notification rides along in a
	// CTE joined into the result so it runs exactly once per call.
	insert := `INSERT INTO ` + pgsql.Table(cfg.Schema, "outbox") + ` (event_id, topic, partition_key, key_hash, payload, metadata)
	SELECT e, ` + topic + `, k, h, p, m::jsonb FROM unnest(` + cols + `) AS u(` + as + `)
	RETURNING 1`
	if cfg.DisableNotify {
		return `WITH ins AS (` + insert + `) SELECT count(*) FROM ins`
	}
	return `WITH ins AS (` + insert + `), wake AS (SELECT pg_notify($7, '')) SELECT count(*) FROM ins, wake`
}

// Config returns the writer's configuration with defaults filled in.
func (w *Writer) Config() Config { return w.cfg }

var defaultWriter, _ = NewWriter(Config{})

// WriteTx writes msgs with the default configuration (schema "onceflow", 1 MiB limit,
// notify on commit). See Writer.WriteTx.
func WriteTx(ctx context.Context, tx pgx.Tx, topic string, msgs ...*message.Message) error {
	return defaultWriter.WriteTx(ctx, tx, topic, msgs...)
}

// WriteTx inserts msgs into the outbox as part of tx, in one statement (one round trip),
// keeping each message's UUID, payload bytes, metadata and partition key. Each message goes to
// the topic it was given with ToTopic, or else to topic; topic may be "" when every message
// names its own. The rows become visible to the relay when tx commits and vanish if it rolls
// back; they are published in the order of msgs (per partition key). If any message is
// invalid, nothing of the call is written and the error lists every refused message (see
// ValidationError).
func (w *Writer) WriteTx(ctx context.Context, tx pgx.Tx, topic string, msgs ...*message.Message) error {
	if len(msgs) == 0 {
		return fmt.Errorf("outbox: %w", ErrNoMessages)
	}
	topics := make([]string, len(msgs))
	ids := make([]string, len(msgs))
	keys := make([]string, len(msgs))
	hashes := make([]int64, len(msgs))
	payloads := make([][]byte, len(msgs))
	metas := make([]string, len(msgs))
	routed := false // some message's topic differs from the first one's
	var problems []error
	for i, msg := range msgs {
		if msg == nil {
			problems = append(problems, &ValidationError{Index: i, Err: errors.New("message is nil")})
			continue
		}
		topics[i] = TopicOf(msg, topic)
		id, err := uuid.Parse(msg.UUID)
		switch {
		case topics[i] == "":
			problems = append(problems, &ValidationError{Index: i, UUID: msg.UUID,
				Err: fmt.Errorf("%w: pass a topic to the write call or address the message with outbox.ToTopic", ErrEmptyTopic)})
		case err != nil:
			problems = append(problems, &ValidationError{Index: i, UUID: msg.UUID, Err: ErrInvalidUUID})
		case msg.Payload == nil:
			problems = append(problems, &ValidationError{Index: i, UUID: msg.UUID, Err: ErrNilPayload})
		case len(msg.Payload) > w.cfg.MaxPayloadBytes:
			problems = append(problems, &ValidationError{Index: i, UUID: msg.UUID,
				Err: fmt.Errorf("%w: %d bytes > %d (raise Config.MaxPayloadBytes, and the broker's message.max.bytes, or store the data elsewhere and send a reference)", ErrPayloadTooLarge, len(msg.Payload), w.cfg.MaxPayloadBytes)})
		}
		if len(problems) > 0 {
			continue // keep validating to report every problem, but build nothing more
		}
		meta, err := json.Marshal(w.traced(ctx, topics[i], msg, storedMetadata(msg.Metadata)))
		if err != nil {
			return fmt.Errorf("outbox: encode metadata of message %d: %w", i, err)
		}
		routed = routed || topics[i] != topics[0]
		ids[i] = id.String()
		keys[i] = PartitionKey(msg)
		hashes[i] = int64(keyHash(keys[i], ids[i]))
		payloads[i] = msg.Payload
		metas[i] = string(meta)
	}
	if err := errors.Join(problems...); err != nil {
		return err
	}
	sql, args := w.insertSQL, []any{topics[0], ids, keys, hashes, payloads, metas}
	if routed {
		sql, args[0] = w.insertRoutedSQL, topics
	}
	if !w.cfg.DisableNotify {
		args = append(args, NotifyChannel(w.cfg.Schema))
	}
	var n int64
	if err := tx.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		return fmt.Errorf("outbox: insert %d messages into %s.outbox: %w", len(msgs), w.cfg.Schema, err)
	}
	if n != int64(len(msgs)) {
		return fmt.Errorf("outbox: inserted %d rows for %d messages", n, len(msgs))
	}
	return nil
}

// storedMetadata is md without the routing key, which is consumed by the write. The caller's
// map is never modified.
func storedMetadata(md message.Metadata) message.Metadata {
	if _, ok := md[MetadataTopic]; !ok {
		return md
	}
	out := make(message.Metadata, len(md)-1)
	for k, v := range md {
		if k != MetadataTopic {
			out[k] = v
		}
	}
	return out
}

// keyHash spreads rows over the relay's virtual shards: FNV-1a 32 of the partition key, so all
// messages of a key land in one shard (and keep their order); messages without a key are
// spread by their id.
func keyHash(key, id string) uint32 {
	h := fnv.New32a()
	if key == "" {
		key = id
	}
	h.Write([]byte(key))
	return h.Sum32()
}
