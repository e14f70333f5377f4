// Package fromforwarder moves the messages still pending in a Watermill forwarder's SQL table
// (watermill-sql's PostgreSQL adapters) into onceflow's outbox, so a service switches from
// Watermill's forwarder to the onceflow relay without losing or doubling a pending event.
//
// It reads the table the way the forwarder's own subscriber does — no watermill-sql code is
// linked: its table layouts are stable SQL — and, batch by batch, in one transaction each,
// writes the unwrapped messages into the outbox (same UUID, payload, metadata, destination
// topic, partition key from the envelope's metadata, in the forwarder's order) and records
// them as consumed the way the forwarder would: the consumer group's offset row advances
// (DefaultPostgreSQLSchema) or the rows are marked acked or deleted (PostgreSQLQueueSchema).
// A crash loses at most the batch in flight, which rolled back; a rerun continues after the
// last committed batch, so no row is moved twice.
//
// The batch transaction locks the consumer group's offset row (or the queue rows) exactly as
// the forwarder's subscriber does, so even a forwarder that was not stopped cannot publish a
// row once it was moved, and Move never moves a row the forwarder acknowledged. A row the
// forwarder published but did not acknowledge (killed between its publish and its ack) is
// still pending in the table: Move moves it and the relay publishes it again — never a loss.
// Under its own UUID (a canonical, lower-case UUID) that is a duplicate a consumer behind
// onceflow's inbox skips; a remapped row (below) goes out under its new event id, which the
// inbox takes for a new message, so stop the forwarder cleanly (close its router, which waits
// for the message in hand to be acknowledged) rather than kill it when its ids are not
// canonical UUIDs. Move still
// refuses to start while another session uses the forwarder's tables (see
// ErrForwarderRunning), because rows split between the two paths would lose their order per
// key across the switch.
//
// Every row a forwarder table can hold moves: a Watermill UUID that is not a UUID (a ULID, a
// short UUID, any string: all valid Watermill ids) gets the deterministic event id
// UUIDv5(IDNamespace, original), and the original is kept in the metadata entry
// MetadataOriginalUUID (also for a UUID written in another form than the canonical one);
// payloads are accepted up to Config.MaxPayloadBytes (default 64 MiB, the relay's batch
// budget). A row that still cannot be moved (not a forwarder envelope, over the limit) stops
// the move with an error naming it, or, with Config.SkipUnmovable, is set aside in
// forwarder_move_skipped (envelope and reason) and reported, and the move goes on.
//
// Move reports the table drained only once every transaction that was already open when it
// started has ended (wherever it got its transaction id: a transaction that began before the
// move and writes its row afterwards is waited for) and no committed row is left behind an
// older transaction (the forwarder's visibility rule).
//
// The `onceflow migrate from-forwarder` command runs Move.
package fromforwarder

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/config"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/sqltx"
	"github.com/onceflow/onceflow/outbox"
)

// The watermill-sql table layouts Move reads.
const (
	// AdapterDefault is watermill-sql's DefaultPostgreSQLSchema with
	// DefaultPostgreSQLOffsetsAdapter: rows keep their place; a consumer group's progress is
	// one row (offset_acked, last_processed_transaction_id) in the offsets table.
	AdapterDefault = "default"
	// AdapterQueue is PostgreSQLQueueSchema with PostgreSQLQueueOffsetsAdapter: consumed rows
	// are marked acked (or deleted with DeleteOnAck); no consumer groups.
	AdapterQueue = "queue"
)

// Defaults of Config.
const (
	DefaultTopic        = "forwarder_topic" // Watermill's forwarder.Config.ForwarderTopic default
	DefaultBatchSize    = 500
	DefaultWaitOpenTxns = time.Minute
	DefaultCheckWindow  = 5 * time.Second
	// DefaultMaxPayloadBytes is the relay's own bound, the byte budget of one batch
	// (relay.DefaultMaxBatchBytes; a larger row still goes, alone). The Kafka sink refuses
	// records above its MaxMessageBytes (about 1 MB by default): Result.Largest says what to
	// raise it to.
	DefaultMaxPayloadBytes = 64 << 20
)

// MetadataOriginalUUID is the metadata entry that keeps a moved message's Watermill UUID when
// its event id differs from it (an id that is not a UUID, or a UUID not in canonical form).
const MetadataOriginalUUID = "watermill_original_uuid"

// IDNamespace is the namespace of the UUIDv5 event id given to a message whose Watermill UUID
// is not a UUID: uuid.NewSHA1(IDNamespace, []byte(original)). The same message moved twice
// (a rerun, a rollback and a new move) gets the same id, so consumers' dedup still works.
var IDNamespace = uuid.MustParse("8a5f3c2e-6b1d-4f7a-9c3e-2d4b6a8f0e17")

// ErrForwarderRunning is returned when the forwarder's subscriber still reads the table. Move
// looks twice: sessions whose current statement (pg_stat_activity) uses the offsets table
// (default adapter) or locks the queue's rows (queue adapter); and, over Config.CheckWindow,
// PostgreSQL's scan counters of that table (pg_stat_all_tables: seq_scan + idx_scan), which a
// polling subscriber raises every poll (producers only insert, which is not a scan). Both are
// readable by any role. Set Config.Force when you are sure (for example a monitoring tool
// scanned the table).
var ErrForwarderRunning = errors.New("fromforwarder: the forwarder still consumes the table; stop it (or set Force / --force)")

// ErrOpenTransactions is returned when transactions that were open when Move started are
// still open after Config.WaitOpenTransactions: one of them may still commit a row into the
// forwarder's table (a producer not switched yet), so Move does not declare the table
// drained. Everything visible was moved; run Move again once they ended.
var ErrOpenTransactions = errors.New("fromforwarder: transactions that may still write into the forwarder's table are open")

// Config says which table to move and how. The zero value moves the default forwarder topic
// ("forwarder_topic") of watermill-sql's default adapter, consumer group "", into the
// "onceflow" schema.
type Config struct {
	// Schema is onceflow's schema (the outbox). Default "onceflow".
	Schema string
	// Adapter is AdapterDefault (default) or AdapterQueue: the watermill-sql schema adapter
	// the forwarder's publisher and subscriber were built with.
	Adapter string
	// Topic is the forwarder's SQL topic (forwarder.Config.ForwarderTopic). Default
	// "forwarder_topic". It names the default tables.
	Topic string
	// Table is the messages table, as written in SQL (optionally schema-qualified, quoted or
	// not): set it when the forwarder used GenerateMessagesTableName. Default
	// "watermill_<Topic>".
	Table string
	// OffsetsTable is the default adapter's offsets table (GenerateMessagesOffsetsTableName).
	// Default "watermill_offsets_<Topic>".
	OffsetsTable string
	// ConsumerGroup is the forwarder subscriber's consumer group (SubscriberConfig.ConsumerGroup).
	// Default "".
	ConsumerGroup string
	// Delete deletes moved rows of the queue adapter instead of marking them acked. Default
	// false: marked rows stay, which is what a rollback to the forwarder needs. (The default
	// adapter's rows always stay; its offset row records the progress.)
	Delete bool
	// PartitionKeyMetadata is the envelope metadata entry holding the message's Kafka key,
	// which a forwarder setup passes to its Kafka marshaler (e.g. watermill-kafka's
	// NewWithPartitioningMarshaler reading msg.Metadata.Get("partition_key")). Its value
	// becomes the outbox row's partition key. Default outbox.MetadataPartitionKey
	// ("partition_key"). Messages without it are published without a key, as the forwarder's
	// default marshaler did.
	PartitionKeyMetadata string
	// BatchSize is the number of rows per transaction. Default 500.
	BatchSize int
	// MaxPayloadBytes is the largest message payload moved. Default DefaultMaxPayloadBytes
	// (64 MiB).
	MaxPayloadBytes int
	// SkipUnmovable sets rows that cannot be moved (not a forwarder envelope, payload over
	// MaxPayloadBytes) aside in the forwarder_move_skipped table, with their envelope and the
	// reason, consumes them like moved rows and goes on (Result.Skipped lists them). Default
	// false: such a row stops the move with an error naming it, before anything of its batch
	// is moved.
	SkipUnmovable bool
	// DryRun reads what would be moved and changes nothing.
	DryRun bool
	// Force skips the check for a running forwarder (ErrForwarderRunning).
	Force bool
	// CheckWindow is how long Move watches the table's scan counters for a polling forwarder
	// (two scans or more) before it starts. Default 5 s: several polls of a forwarder at
	// watermill-sql's default PollInterval (1 s); PostgreSQL publishes a session's counters
	// about every second. Make it at least three times a longer PollInterval.
	CheckWindow time.Duration
	// WaitOpenTransactions is how long Move waits, once the visible rows are moved, for
	// transactions that were already open when it started (they may still commit rows into
	// the table). Default 1 minute; negative: do not wait (report ErrOpenTransactions at once).
	WaitOpenTransactions time.Duration
	// Logger receives one line per batch. Default: discard.
	Logger *slog.Logger
}

// Result says what Move did (or, with DryRun, would do).
type Result struct {
	Moved   int            // rows moved (DryRun: rows that would move)
	Batches int            // transactions committed
	Topics  map[string]int // moved rows per destination topic
	Keys    int            // distinct partition keys among the moved rows
	// HeldBack counts visible rows not moved because a transaction older than them is still
	// open (the forwarder's own visibility rule; DryRun, default adapter).
	HeldBack int
	FirstID  string // Watermill UUID of the first moved message
	LastID   string // and of the last
	// Remapped counts moved messages whose event id differs from their Watermill UUID (kept
	// in MetadataOriginalUUID).
	Remapped int
	// Skipped lists the rows set aside (Config.SkipUnmovable; DryRun: every row that cannot
	// be moved, with or without SkipUnmovable).
	Skipped []Skipped
	// Largest is the largest payload moved, in bytes: the relay's sink must accept it
	// (relaykafka's MaxMessageBytes, --max-message-bytes, and the topic's max.message.bytes).
	Largest int
	// TotalMoved counts the rows moved (or set aside) from this table by every run so far,
	// this one included (the forwarder_move bookkeeping table, migration 0010).
	TotalMoved int64
	// Start is the forwarder's position before the first row was moved, by the first run
	// (recorded in forwarder_move, so a rerun after a crash reports the same): the
	// statement in RollbackSQL puts it back. Queue adapter: Offset is the first moved row's.
	Start Position
	// End is the position after the last batch.
	End Position
	// RollbackSQL, for the default adapter, resets the consumer group's offset to Start, so a
	// restarted forwarder publishes the moved rows again (a consumer behind onceflow's inbox
	// skips those the relay already delivered). For the queue adapter it un-acks the moved rows
	// (impossible after Delete).
	RollbackSQL string
}

// Skipped is a row set aside instead of moved.
type Skipped struct {
	Offset int64
	UUID   string // the row's uuid column
	Reason string
}

// Position is a default-adapter consumer group's offset: the last consumed row.
type Position struct {
	TransactionID string // xid8, as text
	Offset        int64
}

var identPart = regexp.MustCompile(`^("([^"]|"")+"|[A-Za-z_][A-Za-z0-9_$]*)$`)

// sqlName checks a table name as written in SQL (name, schema.name, quoted or not) and
// returns it, and its last part unquoted (for the activity check).
func sqlName(what, s string) (string, string, error) {
	parts := splitName(s)
	if len(parts) == 0 || len(parts) > 2 {
		return "", "", fmt.Errorf("%s %q: write a table name, optionally schema-qualified (watermill_forwarder_topic, app.\"watermill_events\")", what, s)
	}
	for _, p := range parts {
		if !identPart.MatchString(p) {
			return "", "", fmt.Errorf("%s %q: %q is not an identifier", what, s, p)
		}
	}
	last := parts[len(parts)-1]
	if strings.HasPrefix(last, `"`) {
		last = strings.ReplaceAll(last[1:len(last)-1], `""`, `"`)
	} else {
		last = strings.ToLower(last)
	}
	return s, last, nil
}

// splitName splits on dots outside double quotes.
func splitName(s string) []string {
	var parts []string
	quoted, start := false, 0
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '"':
			quoted = !quoted
		case '.':
			if !quoted {
				parts = append(parts, s[start:i])
				start = i + 1
			}
		}
	}
	return append(parts, s[start:])
}

type mover struct {
	cfg                 Config
	table, offsets      string // SQL
	tableName, offsName string // unquoted last parts
	writer              *outbox.Writer
	log                 *slog.Logger
	// source names the moved table in forwarder_move; book is that table, skipped the table
	// of rows set aside.
	source, book, skipped string
}

func newMover(cfg Config) (*mover, error) {
	var problems []error
	if cfg.Schema == "" {
		cfg.Schema = pgsql.DefaultSchema
	}
	if cfg.Adapter == "" {
		cfg.Adapter = AdapterDefault
	}
	if cfg.Topic == "" {
		cfg.Topic = DefaultTopic
	}
	if cfg.PartitionKeyMetadata == "" {
		cfg.PartitionKeyMetadata = outbox.MetadataPartitionKey
	}
	if cfg.BatchSize == 0 {
		cfg.BatchSize = DefaultBatchSize
	}
	if cfg.CheckWindow == 0 {
		cfg.CheckWindow = DefaultCheckWindow
	}
	if cfg.MaxPayloadBytes == 0 {
		cfg.MaxPayloadBytes = DefaultMaxPayloadBytes
	}
	if cfg.MaxPayloadBytes < 0 {
		problems = append(problems, fmt.Errorf("MaxPayloadBytes %d: use 0 for the default (%d) or a positive limit", cfg.MaxPayloadBytes, DefaultMaxPayloadBytes))
	}
	if cfg.WaitOpenTransactions == 0 {
		cfg.WaitOpenTransactions = DefaultWaitOpenTxns
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Adapter != AdapterDefault && cfg.Adapter != AdapterQueue {
		problems = append(problems, fmt.Errorf("Adapter %q: use %q (DefaultPostgreSQLSchema) or %q (PostgreSQLQueueSchema)", cfg.Adapter, AdapterDefault, AdapterQueue))
	}
	if cfg.BatchSize < 0 || cfg.BatchSize > 10000 {
		problems = append(problems, fmt.Errorf("BatchSize %d: use 1 to 10000", cfg.BatchSize))
	}
	if cfg.Adapter == AdapterQueue && cfg.ConsumerGroup != "" {
		problems = append(problems, errors.New("ConsumerGroup: watermill-sql's queue adapter has no consumer groups; leave it empty"))
	}
	if cfg.Adapter == AdapterDefault && cfg.Delete {
		problems = append(problems, errors.New("Delete: only for the queue adapter (the default adapter's progress is its offset row)"))
	}
	m := &mover{cfg: cfg, log: cfg.Logger}
	if cfg.Table == "" {
		cfg.Table = pgx.Identifier{"watermill_" + cfg.Topic}.Sanitize()
	}
	if cfg.OffsetsTable == "" {
		cfg.OffsetsTable = pgx.Identifier{"watermill_offsets_" + cfg.Topic}.Sanitize()
	}
	var err error
	if m.table, m.tableName, err = sqlName("Table", cfg.Table); err != nil {
		problems = append(problems, err)
	}
	if m.offsets, m.offsName, err = sqlName("OffsetsTable", cfg.OffsetsTable); err != nil {
		problems = append(problems, err)
	}
	// No NOTIFY: the relays are not running yet during a switch (and wake up by polling).
	if m.writer, err = outbox.NewWriter(outbox.Config{Schema: cfg.Schema, DisableNotify: true, MaxPayloadBytes: max(cfg.MaxPayloadBytes, 1)}); err != nil {
		problems = append(problems, err)
	}
	if err := config.Check("fromforwarder", problems...); err != nil {
		return nil, err
	}
	m.cfg = cfg
	m.source = cfg.Adapter + " " + m.table + " " + cfg.ConsumerGroup
	m.book = pgsql.Table(cfg.Schema, "forwarder_move")
	m.skipped = pgsql.Table(cfg.Schema, "forwarder_move_skipped")
	return m, nil
}

// pendingRow is one row of the forwarder's table.
type pendingRow struct {
	offset  int64
	txid    string // default adapter
	uuid    string
	payload []byte // the envelope (JSON or bytea column, read as its bytes)
}

// envelope is Watermill forwarder's message envelope (components/forwarder/envelope.go).
type envelope struct {
	DestinationTopic string            `json:"destination_topic"`
	UUID             string            `json:"uuid"`
	Payload          []byte            `json:"payload"`
	Metadata         map[string]string `json:"metadata"`
}

// unwrap turns a row into the message the forwarder would have published. An error means
// the row cannot be moved (see Config.SkipUnmovable).
func (m *mover) unwrap(r pendingRow) (*message.Message, string, error) {
	var e envelope
	if err := json.Unmarshal(r.payload, &e); err != nil {
		return nil, "", fmt.Errorf("not a forwarder envelope: %w", err)
	}
	if e.DestinationTopic == "" {
		return nil, "", errors.New("not a forwarder envelope: no destination_topic")
	}
	if len(e.Payload) > m.cfg.MaxPayloadBytes {
		return nil, "", fmt.Errorf("payload of %d bytes, over the %d-byte limit (Config.MaxPayloadBytes, --max-payload-bytes)", len(e.Payload), m.cfg.MaxPayloadBytes)
	}
	if e.Payload == nil {
		e.Payload = []byte{}
	}
	var id string
	if u, err := uuid.Parse(e.UUID); err != nil {
		id = uuid.NewSHA1(IDNamespace, []byte(e.UUID)).String()
	} else {
		id = u.String()
	}
	msg := message.NewMessage(id, e.Payload)
	for k, v := range e.Metadata {
		msg.Metadata.Set(k, v)
	}
	if id != e.UUID {
		msg.Metadata.Set(MetadataOriginalUUID, e.UUID)
	}
	if key := e.Metadata[m.cfg.PartitionKeyMetadata]; key != "" {
		outbox.SetPartitionKey(msg, key)
	}
	outbox.ToTopic(msg, e.DestinationTopic)
	return msg, e.DestinationTopic, nil
}

// Move moves the forwarder's pending rows into the outbox (see the package documentation).
// It returns what it moved, also when it fails part way (the batches before the error are
// committed; run it again to continue).
func Move(ctx context.Context, pool *pgxpool.Pool, cfg Config) (Result, error) {
	m, err := newMover(cfg)
	if err != nil {
		return Result{}, err
	}
	return m.run(ctx, pool)
}

func (m *mover) run(ctx context.Context, pool *pgxpool.Pool) (res Result, _ error) {
	res = Result{Topics: map[string]int{}}
	if !m.cfg.Force {
		if err := m.checkActivity(ctx, pool); err != nil {
			return res, err
		}
	}
	// What was open when Move started: the transactions of this database's sessions, each of
	// which holds its virtual transaction id from its first statement on, whether or not it
	// took a transaction id yet (a transaction that began before the move may write its row
	// only afterwards, with a transaction id newer than any the move saw), and the prepared
	// transactions. One of them may be a producer whose row is not written or not visible yet.
	// pg_locks shows every session's locks to any role.
	var openAtStart, preparedAtStart []string
	if err := pool.QueryRow(ctx, `SELECT
		coalesce((SELECT array_agg(l.virtualxid) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE l.locktype = 'virtualxid' AND l.granted AND l.pid <> pg_backend_pid()
			AND a.datname = current_database() AND a.backend_type = 'client backend'), '{}'),
		coalesce((SELECT array_agg(transaction::text) FROM pg_prepared_xacts WHERE database = current_database()), '{}')`).
		Scan(&openAtStart, &preparedAtStart); err != nil {
		return res, fmt.Errorf("fromforwarder: %w", err)
	}
	var after Position // dry run: where the next read starts
	if m.cfg.Adapter == AdapterDefault {
		pos, err := m.position(ctx, pool)
		if err != nil {
			return res, err
		}
		after, res.End = pos, pos
	}
	// The first run's starting point is kept in forwarder_move; later runs report it.
	if !m.cfg.DryRun {
		if _, err := pool.Exec(ctx, `INSERT INTO `+m.book+` (source, start_transaction_id, start_offset) VALUES ($1, $2, $3)
			ON CONFLICT (source) DO NOTHING`, m.source, after.TransactionID, after.Offset); err != nil {
			return res, m.explain(err)
		}
	}
	switch err := pool.QueryRow(ctx, `SELECT start_transaction_id, start_offset, moved FROM `+m.book+` WHERE source = $1`, m.source).
		Scan(&res.Start.TransactionID, &res.Start.Offset, &res.TotalMoved); {
	case errors.Is(err, pgx.ErrNoRows): // a dry run before any move
		res.Start = after
	case err != nil:
		return res, m.explain(err)
	}
	defer func() { res.RollbackSQL = m.rollbackSQL(res) }()
	keys := map[string]struct{}{}
	var deadline time.Time
	for retries := 0; ; {
		n, err := m.batch(ctx, pool, &res, keys, &after)
		if sqltx.SQLState(err) == "40001" && retries < 10 {
			// A forwarder (started despite the check) committed an ack on the offset row
			// this batch waited for: read again from its new position.
			retries++
			continue
		}
		if err != nil {
			res.Keys = len(keys)
			return res, err
		}
		if n > 0 {
			continue
		}
		if m.cfg.DryRun {
			// Rows held back behind an older transaction would move once it ends: wait for
			// them as a move would, then report those still held back.
			if m.cfg.Adapter == AdapterDefault {
				held, err := m.heldBack(ctx, pool, after)
				if err != nil {
					return res, err
				}
				if deadline.IsZero() {
					deadline = time.Now().Add(m.cfg.WaitOpenTransactions)
				}
				if held > 0 && m.cfg.WaitOpenTransactions >= 0 && time.Now().Before(deadline) {
					select {
					case <-ctx.Done():
						return res, ctx.Err()
					case <-time.After(200 * time.Millisecond): // polling: PostgreSQL signals no transaction end
					}
					continue
				}
				res.HeldBack = held
			}
			break
		}
		// Nothing movable is left. Drained once every transaction open at the start has ended
		// and no committed row waits behind an older transaction.
		waiting, err := m.waitingFor(ctx, pool, openAtStart, preparedAtStart, after)
		if err != nil {
			return res, err
		}
		if waiting == "" {
			break
		}
		if deadline.IsZero() {
			deadline = time.Now().Add(m.cfg.WaitOpenTransactions)
			m.log.Info("fromforwarder waiting", "for", waiting, "up_to", m.cfg.WaitOpenTransactions)
		}
		if time.Now().After(deadline) || m.cfg.WaitOpenTransactions < 0 {
			res.Keys = len(keys)
			return res, fmt.Errorf("%w: %s", ErrOpenTransactions, waiting)
		}
		select {
		case <-ctx.Done():
			return res, ctx.Err()
		case <-time.After(200 * time.Millisecond): // polling: PostgreSQL signals no transaction end
		}
	}
	res.Keys = len(keys)
	return res, nil
}

// rollbackSQL is the statement that hands the moved rows back to the forwarder.
func (m *mover) rollbackSQL(res Result) string {
	switch {
	case m.cfg.Adapter == AdapterDefault:
		return fmt.Sprintf(`UPDATE %s SET offset_acked = %d, last_processed_transaction_id = '%s' WHERE consumer_group = %s;`,
			m.offsets, res.Start.Offset, res.Start.TransactionID, quoteLiteral(m.cfg.ConsumerGroup))
	case m.cfg.Delete || res.TotalMoved == 0:
		return "" // deleted rows cannot be handed back
	default:
		return fmt.Sprintf(`UPDATE %s SET acked = false WHERE acked AND "offset" >= %d; -- the moved rows (and any the forwarder acked after them)`,
			m.table, res.Start.Offset)
	}
}

func quoteLiteral(s string) string { return `'` + strings.ReplaceAll(s, `'`, `''`) + `'` }

// position reads (creating it if the forwarder never subscribed) the consumer group's offset.
func (m *mover) position(ctx context.Context, pool *pgxpool.Pool) (Position, error) {
	var p Position
	if !m.cfg.DryRun {
		// What the subscriber does before subscribing: a zero offset to lock.
		if _, err := pool.Exec(ctx, `INSERT INTO `+m.offsets+` (consumer_group, offset_acked, last_processed_transaction_id) VALUES ($1, 0, '0') ON CONFLICT DO NOTHING`, m.cfg.ConsumerGroup); err != nil {
			return p, m.explain(err)
		}
	}
	err := pool.QueryRow(ctx, `SELECT coalesce(offset_acked, 0), last_processed_transaction_id::text FROM `+m.offsets+` WHERE consumer_group = $1`, m.cfg.ConsumerGroup).Scan(&p.Offset, &p.TransactionID)
	if errors.Is(err, pgx.ErrNoRows) { // dry run, never subscribed
		return Position{TransactionID: "0"}, nil
	}
	if err != nil {
		return p, m.explain(err)
	}
	return p, nil
}

func (m *mover) explain(err error) error {
	if pgsql.IsUndefinedTable(err) {
		return fmt.Errorf("fromforwarder: %w (check --table/--offsets-table, --topic and --adapter: they must name the forwarder's watermill-sql tables)", err)
	}
	return fmt.Errorf("fromforwarder: %w", err)
}

// batch moves (or, dry, reads) the next rows in one transaction; it returns how many.
func (m *mover) batch(ctx context.Context, pool *pgxpool.Pool, res *Result, keys map[string]struct{}, after *Position) (int, error) {
	// REPEATABLE READ, as the forwarder's subscriber: one snapshot for the xmin rule and the rows.
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		return 0, fmt.Errorf("fromforwarder: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	var rows pgx.Rows
	if m.cfg.Adapter == AdapterDefault {
		pos := *after
		if !m.cfg.DryRun {
			// The lock the forwarder's subscriber takes for each of its batches.
			if err := tx.QueryRow(ctx, `SELECT coalesce(offset_acked, 0), last_processed_transaction_id::text FROM `+m.offsets+` WHERE consumer_group = $1 FOR UPDATE`,
				m.cfg.ConsumerGroup).Scan(&pos.Offset, &pos.TransactionID); err != nil {
				return 0, m.explain(err)
			}
		}
		// The forwarder's order and visibility rule: (transaction_id, offset) after the
		// group's position, only transactions older than every one still running. The text
		// copy of the id is named txid: named transaction_id, ORDER BY would sort by it as
		// text ("1000" before "733").
		rows, err = tx.Query(ctx, `SELECT "offset", transaction_id::text AS txid, uuid, payload FROM `+m.table+`
			WHERE ((transaction_id = $1::text::xid8 AND "offset" > $2) OR transaction_id > $1::text::xid8)
			AND transaction_id < pg_snapshot_xmin(pg_current_snapshot())
			ORDER BY transaction_id, "offset" LIMIT $3`, pos.TransactionID, pos.Offset, m.cfg.BatchSize)
	} else {
		// Moving: every unacked row, locked as the subscriber locks them (a row of a
		// transaction that commits late, with a lower offset, is still found by the next
		// batch). Dry: read on from the last row seen.
		lock, from := ` FOR UPDATE`, int64(0)
		if m.cfg.DryRun {
			lock, from = "", after.Offset
		}
		rows, err = tx.Query(ctx, `SELECT "offset", '', uuid, payload FROM `+m.table+`
			WHERE NOT acked AND "offset" > $1 ORDER BY "offset" LIMIT $2`+lock, from, m.cfg.BatchSize)
	}
	if err != nil {
		return 0, m.explain(err)
	}
	batch, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (pendingRow, error) {
		var p pendingRow
		err := r.Scan(&p.offset, &p.txid, &p.uuid, &p.payload)
		return p, err
	})
	if err != nil {
		return 0, m.explain(err)
	}
	if len(batch) == 0 {
		return 0, nil
	}
	msgs := make([]*message.Message, 0, len(batch))
	var skipped []Skipped
	var skippedRows []pendingRow
	largest, remapped := 0, 0
	for _, r := range batch {
		msg, topic, err := m.unwrap(r)
		if err != nil {
			if !m.cfg.SkipUnmovable && !m.cfg.DryRun { // a dry run lists them all
				return 0, fmt.Errorf("fromforwarder: row offset %d (uuid %s) cannot be moved: %w; nothing of this batch was moved. "+
					"Rerun with SkipUnmovable (--skip-unmovable) to set such rows aside in %s and go on", r.offset, r.uuid, err, m.skipped)
			}
			skipped = append(skipped, Skipped{Offset: r.offset, UUID: r.uuid, Reason: err.Error()})
			skippedRows = append(skippedRows, r)
			continue
		}
		msgs = append(msgs, msg)
		res.Topics[topic]++
		keys[outbox.PartitionKey(msg)] = struct{}{}
		largest = max(largest, len(msg.Payload))
		if msg.Metadata.Get(MetadataOriginalUUID) != "" {
			remapped++
		}
	}
	last := batch[len(batch)-1]
	lowest := batch[0].offset // queue adapter: rows come in offset order
	if !m.cfg.DryRun {
		if len(msgs) > 0 {
			if err := m.writer.WriteTx(ctx, tx, "", msgs...); err != nil {
				return 0, fmt.Errorf("fromforwarder: %w", err)
			}
		}
		for _, r := range skippedRows {
			if _, err := tx.Exec(ctx, `INSERT INTO `+m.skipped+` (source, "offset", transaction_id, uuid, envelope, reason) VALUES ($1, $2, $3, $4, $5, $6)
				ON CONFLICT (source, "offset", transaction_id) DO NOTHING`,
				m.source, r.offset, r.txid, r.uuid, r.payload, skippedReason(skipped, r.offset)); err != nil {
				return 0, m.explain(err)
			}
		}
		if m.cfg.Adapter == AdapterDefault {
			_, err = tx.Exec(ctx, `UPDATE `+m.offsets+` SET offset_acked = $2, last_processed_transaction_id = $3::text::xid8 WHERE consumer_group = $1`,
				m.cfg.ConsumerGroup, last.offset, last.txid)
		} else {
			offs := make([]int64, len(batch))
			for i, r := range batch {
				offs[i] = r.offset
			}
			q := `UPDATE ` + m.table + ` SET acked = true WHERE "offset" = ANY($1)`
			if m.cfg.Delete {
				q = `DELETE FROM ` + m.table + ` WHERE "offset" = ANY($1)`
			}
			_, err = tx.Exec(ctx, q, offs)
		}
		if err != nil {
			return 0, m.explain(err)
		}
		var firstID, lastID *string
		if len(msgs) > 0 {
			firstID, lastID = &msgs[0].UUID, &msgs[len(msgs)-1].UUID
		}
		// Queue adapter: start_offset is the lowest offset ever moved, so the printed way back
		// also un-acks a row that committed late with an offset below the first batch's.
		if _, err := tx.Exec(ctx, `UPDATE `+m.book+` SET moved = moved + $2,
			start_offset = CASE WHEN NOT $3 THEN start_offset WHEN moved = 0 THEN $4 ELSE least(start_offset, $4) END,
			first_event_id = coalesce(first_event_id, $5::uuid), last_event_id = coalesce($6::uuid, last_event_id), updated_at = now()
			WHERE source = $1`, m.source, len(batch), m.cfg.Adapter == AdapterQueue, lowest, firstID, lastID); err != nil {
			return 0, m.explain(err)
		}
		if err := tx.Commit(ctx); err != nil {
			return 0, fmt.Errorf("fromforwarder: commit: %w", err)
		}
	}
	if len(msgs) > 0 {
		if res.FirstID == "" {
			res.FirstID = msgs[0].UUID
		}
		res.LastID = msgs[len(msgs)-1].UUID
	}
	if m.cfg.Adapter == AdapterQueue {
		if res.TotalMoved == 0 && res.Batches == 0 {
			res.Start.Offset = lowest
		} else {
			res.Start.Offset = min(res.Start.Offset, lowest)
		}
	}
	res.Moved += len(msgs)
	res.Skipped = append(res.Skipped, skipped...)
	res.Largest = max(res.Largest, largest)
	res.Remapped += remapped
	if !m.cfg.DryRun {
		res.TotalMoved += int64(len(batch))
	}
	res.Batches++
	*after = Position{TransactionID: last.txid, Offset: last.offset}
	res.End = *after
	m.log.Info("fromforwarder batch", "rows", len(batch), "skipped", len(skipped), "moved", res.Moved, "last_uuid", res.LastID,
		"first_tx", batch[0].txid, "first_offset", batch[0].offset, "last_tx", last.txid, "last_offset", last.offset, "dry_run", m.cfg.DryRun)
	return len(batch), nil
}

func skippedReason(skipped []Skipped, offset int64) string {
	for _, s := range skipped {
		if s.Offset == offset {
			return s.Reason
		}
	}
	return ""
}

// checkActivity refuses when the forwarder's subscriber is seen reading the table.
func (m *mover) checkActivity(ctx context.Context, pool *pgxpool.Pool) error {
	// Default adapter: only the subscriber touches the offsets table. Queue adapter: the
	// subscriber's read locks the unacked rows.
	watched, pattern := m.offsets, `%`+likeEscape(m.offsName)+`%`
	if m.cfg.Adapter == AdapterQueue {
		watched, pattern = m.table, `%`+likeEscape(m.tableName)+`%acked = false%`
	}
	found, err := m.sessions(ctx, pool, pattern)
	if err != nil {
		return err
	}
	if len(found) == 0 {
		scans := func() (int64, error) {
			var n int64
			err := pool.QueryRow(ctx, `SELECT coalesce(seq_scan, 0) + coalesce(idx_scan, 0) FROM pg_stat_all_tables WHERE relid = $1::regclass`, watched).Scan(&n)
			if err != nil {
				return 0, m.explain(err)
			}
			return n, nil
		}
		before, err := scans()
		if err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(m.cfg.CheckWindow): // watching counters over a window: no event to await
		}
		after, err := scans()
		if err != nil {
			return err
		}
		// Two scans at least: one can be a session that ended just before the window (a dry
		// run: a backend publishes its counters when it exits), a polling forwarder scans at
		// every poll.
		if after-before >= 2 {
			found = append(found, fmt.Sprintf("%s was scanned %d times in the last %s (a polling subscriber)", watched, after-before, m.cfg.CheckWindow))
		}
		more, err := m.sessions(ctx, pool, pattern)
		if err != nil {
			return err
		}
		found = append(found, more...)
	}
	if len(found) > 0 {
		return fmt.Errorf("%w: %s", ErrForwarderRunning, strings.Join(found, "; "))
	}
	return nil
}

// sessions lists other sessions whose current statement matches pattern.
func (m *mover) sessions(ctx context.Context, pool *pgxpool.Pool, pattern string) ([]string, error) {
	rows, err := pool.Query(ctx, `SELECT pid, coalesce(application_name, ''), coalesce(client_addr::text, 'local'), coalesce(state, '')
		FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid() AND state <> 'idle' AND query ILIKE $1`, pattern)
	if err != nil {
		return nil, fmt.Errorf("fromforwarder: read pg_stat_activity: %w", err)
	}
	defer rows.Close()
	var found []string
	for rows.Next() {
		var pid int64
		var app, addr, state string
		if err := rows.Scan(&pid, &app, &addr, &state); err != nil {
			return nil, fmt.Errorf("fromforwarder: read pg_stat_activity: %w", err)
		}
		found = append(found, fmt.Sprintf("session pid %d (application %q, from %s) is reading it (%s)", pid, app, addr, state))
	}
	return found, rows.Err()
}

func likeEscape(s string) string {
	return strings.NewReplacer(`\`, `\\`, `%`, `\%`, `_`, `\_`).Replace(s)
}

// heldBack counts the committed rows after the default adapter's position pos that the
// forwarder's visibility rule holds back (a transaction older than them is still open).
func (m *mover) heldBack(ctx context.Context, pool *pgxpool.Pool, pos Position) (int, error) {
	var n int
	err := pool.QueryRow(ctx, `SELECT count(*) FROM `+m.table+` WHERE (transaction_id = $1::text::xid8 AND "offset" > $2) OR transaction_id > $1::text::xid8`,
		pos.TransactionID, pos.Offset).Scan(&n)
	if err != nil {
		return 0, m.explain(err)
	}
	return n, nil
}

// waitingFor describes what keeps the move from being done ("" when nothing does): the
// transactions of openAtStart and preparedAtStart still open, and, default adapter, committed
// rows after pos that wait behind an older transaction.
func (m *mover) waitingFor(ctx context.Context, pool *pgxpool.Pool, openAtStart, preparedAtStart []string, pos Position) (string, error) {
	var parts []string
	rows, err := pool.Query(ctx, `SELECT l.pid, coalesce(a.application_name, ''), coalesce(extract(epoch FROM now() - a.xact_start), -1)::bigint
		FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
		WHERE l.locktype = 'virtualxid' AND l.granted AND l.virtualxid = ANY($1) ORDER BY l.pid`, openAtStart)
	if err != nil {
		return "", fmt.Errorf("fromforwarder: read pg_locks: %w", err)
	}
	var open []string
	for rows.Next() {
		var pid, secs int64
		var app string
		if err := rows.Scan(&pid, &app, &secs); err != nil {
			rows.Close()
			return "", fmt.Errorf("fromforwarder: read pg_locks: %w", err)
		}
		age := "open since before the move"
		if secs >= 0 {
			age = fmt.Sprintf("open %ds", secs)
		}
		open = append(open, fmt.Sprintf("pid %d (application %q, %s)", pid, app, age))
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return "", fmt.Errorf("fromforwarder: read pg_locks: %w", err)
	}
	if len(open) > 0 {
		parts = append(parts, "transactions that began before the move are still open: "+strings.Join(open, "; "))
	}
	var prepared []string
	if len(preparedAtStart) > 0 {
		prows, err := pool.Query(ctx, `SELECT gid FROM pg_prepared_xacts WHERE transaction::text = ANY($1) ORDER BY gid`, preparedAtStart)
		if err != nil {
			return "", fmt.Errorf("fromforwarder: read pg_prepared_xacts: %w", err)
		}
		if prepared, err = pgx.CollectRows(prows, pgx.RowTo[string]); err != nil {
			return "", fmt.Errorf("fromforwarder: read pg_prepared_xacts: %w", err)
		}
	}
	if len(prepared) > 0 {
		parts = append(parts, "prepared transactions older than the move are neither committed nor rolled back: "+strings.Join(prepared, ", "))
	}
	if m.cfg.Adapter == AdapterDefault {
		n, err := m.heldBack(ctx, pool, pos)
		if err != nil {
			return "", err
		}
		if n > 0 {
			parts = append(parts, fmt.Sprintf("%d committed rows wait behind an older transaction still open in the cluster (the forwarder's visibility rule: transaction_id below every running one)", n))
		}
	}
	return strings.Join(parts, "; "), nil
}
