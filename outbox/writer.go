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
// Code written against database/sql writes into its *sql.Tx with WriteSQLTx (any PostgreSQL
// driver; the same statement as WriteTx).
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
	"sync/atomic"
	"time"

	"github.com/onceflow/onceflow/internal/config"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/sqltx"
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
	// DisableNotify never wakes a sleeping relay; relays then find the rows at their next
	// poll (up to relay.Config.PollInterval later when they are idle). Default false: a write
	// sends a NOTIFY on NotifyChannel(Schema), delivered at commit, only while some relay of the
	// schema is asleep (no rows for a while, waiting for NOTIFY); while relays poll for traffic
	// nothing is sent. PostgreSQL's NOTIFY takes a cluster-wide lock from commit until the
	// commit is flushed, so sending one in every transaction would serialise every writer of
	// the cluster.
	DisableNotify bool
	// TracerProvider records a `create <topic>` span per message written (see docs/operations.md,
	// "Tracing"). Default nil: the global provider (otel.GetTracerProvider).
	TracerProvider trace.TracerProvider
	// Propagator writes the span context into the message metadata. Default nil: the global
	// propagator, or W3C trace context (traceparent/tracestate) when none is installed.
	Propagator propagation.TextMapPropagator
}

// WakeCheckInterval is how long a Writer trusts that every relay is awake before it asks the
// database again. A write call that asks costs slightly more (it calls the schema's
// outbox_wake function, which notifies if a relay sleeps); the others are a plain INSERT. A
// relay that goes to sleep keeps polling tightly for longer than this, so writers that still
// believe it awake are found without a notification.
const WakeCheckInterval = 10 * time.Millisecond

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
	// plain and wake hold the statements without and with the wake-up check.
	plain, wake statements
	// scheduled writes a call with scheduled messages (schedule.go).
	scheduled string
	// awakeAt is when a write last found every relay awake (UnixNano; 0 = check on the next
	// write): until WakeCheckInterval after it, writes skip the check.
	awakeAt atomic.Int64
	tracer  *tracing.Tracer
}

// statements are the three shapes of a write: one message; several with one topic ($1 text);
// several with a topic each ($1 text[], for calls whose messages go to several topics).
type statements struct{ one, many, routed string }

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
	w := &Writer{cfg: cfg, tracer: tracing.New(cfg.TracerProvider, cfg.Propagator)}
	cols := `INSERT INTO ` + pgsql.Table(cfg.Schema, "outbox") + ` (event_id, topic, partition_key, key_hash, payload, metadata) `
	// One statement, one round trip. A single message (the common case: one event per business
	// transaction) is a plain VALUES insert, as cheap as any INSERT of these columns; several
	// are unnested in order, so ids (the relay's claim order) follow the order of the messages.
	w.plain = statements{
		one:    cols + `VALUES ($2::uuid, $1, $3, $4, $5, $6::jsonb)`,
		many:   cols + `SELECT e, $1, k, h, p, m::jsonb FROM unnest($2::uuid[], $3::text[], $4::bigint[], $5::bytea[], $6::text[]) AS u(e, k, h, p, m)`,
		routed: cols + `SELECT e, t, k, h, p, m::jsonb FROM unnest($1::text[], $2::uuid[], $3::text[], $4::bigint[], $5::bytea[], $6::text[]) AS u(t, e, k, h, p, m)`,
	}
	// The checking variant also calls outbox_wake once per call: it notifies on commit when a
	// relay sleeps, and says whether one does.
	wake := func(insert string) string {
		return `WITH ins AS (` + insert + ` RETURNING 1) SELECT (SELECT count(*) FROM ins), ` + pgsql.Ident(cfg.Schema) + `.outbox_wake($7)`
	}
	w.wake = statements{one: wake(w.plain.one), many: wake(w.plain.many), routed: wake(w.plain.routed)}
	w.scheduled = scheduledInsert(cfg.Schema)
	return w, nil
}

// Config returns the writer's configuration with defaults filled in.
func (w *Writer) Config() Config { return w.cfg }

var defaultWriter, _ = NewWriter(Config{})

// WriteTx writes msgs with the default configuration (schema "onceflow", 1 MiB limit,
// sleeping relays woken on commit). See Writer.WriteTx.
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
	return w.write(ctx, sqltx.Pgx(tx), topic, msgs)
}

// write runs the statement insert builds on either kind of transaction (q): the pgx path and
// the database/sql path (WriteSQLTx) run the same SQL.
func (w *Writer) write(ctx context.Context, q sqltx.Querier, topic string, msgs []*message.Message) error {
	ins, err := w.insert(ctx, topic, msgs)
	if err != nil {
		return err
	}
	if !ins.row {
		n, err := q.Exec(ctx, ins.sql, ins.args...)
		if err != nil {
			return w.insertError(len(msgs), err)
		}
		return ins.inserted(n)
	}
	var n int64
	var asleep bool
	if err := q.QueryRow(ctx, ins.sql, ins.args...).Scan(&n, &asleep); err != nil {
		return w.insertError(len(msgs), err)
	}
	if ins.check {
		w.sawRelays(asleep)
	}
	return ins.inserted(n)
}

// QueueWriteTx queues WriteTx's statement into b, for a caller that sends it with statements
// of its own in one round trip (tx.SendBatch(ctx, b)): the saga orchestrator writes a
// transition's commands with the saga row's update. The messages are validated now (nothing
// is queued when one is refused); the insert's own error, if any, is returned by the batch.
func (w *Writer) QueueWriteTx(ctx context.Context, b *pgx.Batch, topic string, msgs ...*message.Message) error {
	ins, err := w.insert(ctx, topic, msgs)
	if err != nil {
		return err
	}
	if !ins.row {
		b.Queue(ins.sql, ins.args...).Exec(func(tag pgconn.CommandTag) error { return ins.inserted(tag.RowsAffected()) })
		return nil
	}
	b.Queue(ins.sql, ins.args...).QueryRow(func(row pgx.Row) error {
		var n int64
		var asleep bool
		if err := row.Scan(&n, &asleep); err != nil {
			return w.insertError(len(msgs), err)
		}
		if ins.check {
			w.sawRelays(asleep)
		}
		return ins.inserted(n)
	})
	return nil
}

// insertStmt is one write's statement: check says whether it also asks outbox_wake; row, whether
// it returns the row count and whether a relay sleeps (always with check; also for every call
// with scheduled messages, whose statement reports its count that way).
type insertStmt struct {
	sql   string
	args  []any
	check bool
	row   bool
	n     int
}

func (ins insertStmt) inserted(n int64) error {
	if n != int64(ins.n) {
		return fmt.Errorf("outbox: inserted %d rows for %d messages", n, ins.n)
	}
	return nil
}

// sawRelays records what the wake-up check found: while a relay sleeps, every write checks
// (and notifies); once all are awake, writes skip the check for WakeCheckInterval.
func (w *Writer) sawRelays(asleep bool) {
	if asleep {
		w.awakeAt.Store(0) // keep notifying until a relay is seen awake again
	} else {
		w.awakeAt.Store(time.Now().UnixNano())
	}
}

// insert validates msgs and builds the statement that writes them.
func (w *Writer) insert(ctx context.Context, topic string, msgs []*message.Message) (insertStmt, error) {
	if len(msgs) == 0 {
		return insertStmt{}, fmt.Errorf("outbox: %w", ErrNoMessages)
	}
	topics := make([]string, len(msgs))
	ids := make([]string, len(msgs))
	keys := make([]string, len(msgs))
	hashes := make([]int64, len(msgs))
	payloads := make([][]byte, len(msgs))
	metas := make([]string, len(msgs))
	scheds := make([]schedule, len(msgs))
	anyScheduled := false
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
		default:
			if scheds[i], err = scheduleOf(msg); err != nil {
				problems = append(problems, &ValidationError{Index: i, UUID: msg.UUID, Err: err})
			}
		}
		if len(problems) > 0 {
			continue // keep validating to report every problem, but build nothing more
		}
		meta, err := json.Marshal(w.traced(parentOf(ctx, msg), topics[i], msg, storedMetadata(msg.Metadata)))
		if err != nil {
			return insertStmt{}, fmt.Errorf("outbox: encode metadata of message %d: %w", i, err)
		}
		routed = routed || topics[i] != topics[0]
		anyScheduled = anyScheduled || scheds[i].set
		ids[i] = id.String()
		keys[i] = PartitionKey(msg)
		hashes[i] = int64(keyHash(keys[i], ids[i]))
		payloads[i] = msg.Payload
		metas[i] = string(meta)
	}
	if err := errors.Join(problems...); err != nil {
		return insertStmt{}, err
	}
	check := !w.cfg.DisableNotify && time.Duration(time.Now().UnixNano()-w.awakeAt.Load()) >= WakeCheckInterval
	if anyScheduled {
		return w.scheduledStmt(check, topics, ids, keys, hashes, payloads, metas, scheds), nil
	}
	ins := insertStmt{n: len(msgs), check: check, row: check}
	st := w.plain
	if ins.check {
		st = w.wake
	}
	switch {
	case len(msgs) == 1:
		ins.sql, ins.args = st.one, []any{topics[0], ids[0], keys[0], hashes[0], payloads[0], metas[0]}
	case routed:
		ins.sql, ins.args = st.routed, []any{topics, ids, keys, hashes, payloads, metas}
	default:
		ins.sql, ins.args = st.many, []any{topics[0], ids, keys, hashes, payloads, metas}
	}
	if ins.check {
		ins.args = append(ins.args, NotifyChannel(w.cfg.Schema))
	}
	return ins, nil
}

// insertError wraps a failed insert, saying what to run when the schema lacks a migration.
func (w *Writer) insertError(n int, err error) error {
	// SQLState, not *pgconn.PgError: a database/sql driver (lib/pq) has errors of its own.
	if code := sqltx.SQLState(err); code == "42883" || code == "42P01" || code == "42703" {
		// undefined function, table or column: the schema is older than this library.
		return fmt.Errorf("outbox: insert %d messages into %s.outbox: %w (the schema lacks migrations this version needs: run `onceflow migrate up --schema %s` or migrations.Up)", n, w.cfg.Schema, err, w.cfg.Schema)
	}
	return fmt.Errorf("outbox: insert %d messages into %s.outbox: %w", n, w.cfg.Schema, err)
}

// consumedKeys are the metadata keys the write consumes: never stored, never published.
var consumedKeys = map[string]bool{MetadataTopic: true, MetadataDeliverAt: true, MetadataDeliverAfter: true}

// storedMetadata is md without the routing and scheduling keys, which are consumed by the
// write. The caller's map is never modified.
func storedMetadata(md message.Metadata) message.Metadata {
	// Three lookups, not a walk of the map: this runs for every message written.
	n := 0
	for _, k := range [...]string{MetadataTopic, MetadataDeliverAt, MetadataDeliverAfter} {
		if _, ok := md[k]; ok {
			n++
		}
	}
	if n == 0 {
		return md
	}
	out := make(message.Metadata, len(md)-n)
	for k, v := range md {
		if !consumedKeys[k] {
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

// MessageIndex returns Index, the position of the refused message in the write call: the
// consumers map it back to the message whose handler returned it.
func (e *ValidationError) MessageIndex() int { return e.Index }
