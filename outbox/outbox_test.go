package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
)

func TestMain(m *testing.M) { testdb.Main(m) }

type row struct {
	ID       int64
	EventID  string
	Topic    string
	Key      string
	Payload  []byte
	Metadata map[string]string
}

func readRows(t *testing.T, db *testdb.DB) []row {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(),
		`SELECT id, event_id::text, topic, partition_key, payload, metadata FROM `+db.Table("outbox")+` ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
		var x row
		err := r.Scan(&x.ID, &x.EventID, &x.Topic, &x.Key, &x.Payload, &x.Metadata)
		return x, err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func newWriter(t *testing.T, db *testdb.DB, cfg outbox.Config) *outbox.Writer {
	t.Helper()
	cfg.Schema = db.Schema
	w, err := outbox.NewWriter(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// withOrders is a test database with a business table, orders (id int), and a writer.
func withOrders(t *testing.T) (*testdb.DB, *outbox.Writer) {
	t.Helper()
	db := testdb.New(t)
	if _, err := db.Pool.Exec(context.Background(), `CREATE TABLE `+db.Table("orders")+` (id int PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	return db, newWriter(t, db, outbox.Config{})
}

func TestWriteTxAtomic(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, w := withOrders(t)

	// Rolled back: neither the business row nor the events exist.
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+db.Table("orders")+` VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	if err := w.WriteTx(ctx, tx, "orders", outbox.NewMessage([]byte("lost"))); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if got := readRows(t, db); len(got) != 0 {
		t.Fatalf("rolled-back transaction left %d outbox rows", len(got))
	}

	// Committed: the rows carry exactly what was written, in call order.
	msgs := []*message.Message{
		outbox.SetPartitionKey(outbox.NewMessage([]byte(`{"n":1}`)), "order-7"),
		outbox.NewMessage([]byte{0x00, 0xff, 0x10}), // binary payload, no key
		outbox.NewMessage([]byte{}),                 // empty is allowed, nil is not
	}
	msgs[0].Metadata.Set("traceparent", "00-abc-def-01")
	msgs[1].Metadata.Set("name", "Ünïcode ✓")
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO `+db.Table("orders")+` VALUES (2)`); err != nil {
			return err
		}
		return w.WriteTx(ctx, tx, "orders", msgs...)
	})
	if err != nil {
		t.Fatal(err)
	}
	got := readRows(t, db)
	if len(got) != len(msgs) {
		t.Fatalf("got %d rows, want %d", len(got), len(msgs))
	}
	for i, m := range msgs {
		r := got[i]
		if r.EventID != m.UUID || r.Topic != "orders" || string(r.Payload) != string(m.Payload) || r.Key != outbox.PartitionKey(m) {
			t.Errorf("row %d = %+v, want uuid %s payload %q key %q", i, r, m.UUID, m.Payload, outbox.PartitionKey(m))
		}
		if fmt.Sprint(r.Metadata) != fmt.Sprint(map[string]string(m.Metadata)) {
			t.Errorf("row %d metadata = %v, want %v", i, r.Metadata, m.Metadata)
		}
		if u := uuid.MustParse(r.EventID); u.Version() != 7 {
			t.Errorf("row %d event id %s is UUID v%d, want v7", i, r.EventID, u.Version())
		}
	}
}

func TestWriteTxConcurrent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	w := newWriter(t, db, outbox.Config{})
	const writers, perWriter, perTx = 8, 250, 25
	var mu sync.Mutex
	written := map[string]bool{}
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for g := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := 0; n < perWriter; n += perTx {
				batch := make([]*message.Message, perTx)
				for i := range batch {
					batch[i] = outbox.SetPartitionKey(outbox.NewMessage([]byte(fmt.Sprintf("g%d-%d", g, n+i))), fmt.Sprintf("key-%d", g))
				}
				err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return w.WriteTx(ctx, tx, "t", batch...) })
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				for _, m := range batch {
					written[m.UUID] = true
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	got := readRows(t, db)
	if len(got) != writers*perWriter {
		t.Fatalf("got %d rows, want %d", len(got), writers*perWriter)
	}
	seen := map[string]bool{}
	lastPerKey := map[string]string{}
	for _, r := range got {
		if seen[r.EventID] {
			t.Fatalf("event id %s stored twice", r.EventID)
		}
		seen[r.EventID] = true
		if !written[r.EventID] {
			t.Fatalf("unexpected event id %s", r.EventID)
		}
		// Each goroutine writes its key sequentially, so id order is write order per key.
		if prev, ok := lastPerKey[r.Key]; ok && payloadSeq(prev) > payloadSeq(string(r.Payload)) {
			t.Fatalf("key %s: %s stored after %s", r.Key, r.Payload, prev)
		}
		lastPerKey[r.Key] = string(r.Payload)
	}
}

func payloadSeq(p string) int {
	var g, n int
	fmt.Sscanf(p, "g%d-%d", &g, &n)
	return n
}

func TestWriteTxValidation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	w := newWriter(t, db, outbox.Config{MaxPayloadBytes: 16})
	valid := func() *message.Message { return outbox.NewMessage([]byte("ok")) }
	cases := []struct {
		name   string
		topic  string
		msgs   []*message.Message
		target error
		text   string
	}{
		{"empty topic", "", []*message.Message{valid()}, outbox.ErrEmptyTopic, "topic is empty"},
		{"nil payload", "t", []*message.Message{valid(), message.NewMessage(outbox.NewUUID(), nil)}, outbox.ErrNilPayload, "message 1"},
		{"payload too large", "t", []*message.Message{message.NewMessage(outbox.NewUUID(), make([]byte, 17)), valid()}, outbox.ErrPayloadTooLarge, "17 bytes > 16"},
		{"invalid uuid", "t", []*message.Message{valid(), valid(), message.NewMessage("not-a-uuid", []byte("x"))}, outbox.ErrInvalidUUID, `"not-a-uuid"`},
		{"no messages", "t", nil, outbox.ErrNoMessages, "no messages"},
		{"nil message", "t", []*message.Message{valid(), nil}, nil, "message is nil"},
		{"routed and unrouted without topic", "", []*message.Message{outbox.ToTopic(valid(), "a"), valid()}, outbox.ErrEmptyTopic, "message 1"},
		{"empty ToTopic", "t", []*message.Message{outbox.ToTopic(valid(), "")}, outbox.ErrEmptyTopic, "outbox.ToTopic"},
	}
	for _, c := range cases {
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		err = w.WriteTx(ctx, tx, c.topic, c.msgs...)
		if err == nil {
			t.Fatalf("%s: no error", c.name)
		}
		if c.target != nil && !errors.Is(err, c.target) {
			t.Errorf("%s: error %v does not wrap %v", c.name, err, c.target)
		}
		if !strings.Contains(err.Error(), c.text) {
			t.Errorf("%s: error %q does not mention %q", c.name, err, c.text)
		}
		// Validation happens before any SQL, so the transaction is still usable and committing
		// it must not write anything of the refused call.
		if err := tx.Commit(ctx); err != nil {
			t.Fatalf("%s: commit after refused write: %v", c.name, err)
		}
		if got := readRows(t, db); len(got) != 0 {
			t.Fatalf("%s: %d rows written by a refused call", c.name, len(got))
		}
	}
	var ve *outbox.ValidationError
	err := w.WriteTx(ctx, nil, "t", valid(), message.NewMessage("bad", []byte("x")))
	if !errors.As(err, &ve) || ve.Index != 1 || ve.UUID != "bad" {
		t.Fatalf("ValidationError = %+v (from %v), want index 1 uuid bad", ve, err)
	}
}

// queryCounter counts the statements a pool sends.
type queryCounter struct{ n atomic.Int64 }

func (c *queryCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c *queryCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// One call writes messages for several topics (ToTopic, else the call's topic) in ONE
// statement, in the order given, without storing the routing key or changing the caller's
// messages.
func TestWriteTxSeveralTopics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	cfg := db.Pool.Config()
	counter := &queryCounter{}
	cfg.ConnConfig.Tracer = counter
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	w := newWriter(t, db, outbox.Config{})

	msgs := []*message.Message{
		outbox.ToTopic(outbox.NewMessage([]byte("a1")), "topic.a"),
		outbox.NewMessage([]byte("d1")), // the call's topic
		outbox.SetPartitionKey(outbox.ToTopic(outbox.NewMessage([]byte("b1")), "topic.b"), "k"),
		outbox.ToTopic(outbox.NewMessage([]byte("a2")), "topic.a"),
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	before := counter.n.Load()
	if err := w.WriteTx(ctx, tx, "topic.default", msgs...); err != nil {
		t.Fatal(err)
	}
	if n := counter.n.Load() - before; n != 1 {
		t.Errorf("WriteTx sent %d statements for 3 topics, want 1", n)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	rows := readRows(t, db)
	want := []struct{ topic, payload, key string }{{"topic.a", "a1", ""}, {"topic.default", "d1", ""}, {"topic.b", "b1", "k"}, {"topic.a", "a2", ""}}
	if len(rows) != len(want) {
		t.Fatalf("%d rows, want %d", len(rows), len(want))
	}
	for i, r := range rows {
		if r.EventID != msgs[i].UUID || r.Topic != want[i].topic || string(r.Payload) != want[i].payload || r.Key != want[i].key {
			t.Errorf("row %d = %+v, want %+v", i, r, want[i])
		}
		if _, ok := r.Metadata[outbox.MetadataTopic]; ok {
			t.Errorf("row %d stores the routing key: %v", i, r.Metadata)
		}
	}
	if outbox.TopicOf(msgs[0], "") != "topic.a" {
		t.Error("the caller's message lost its routing key")
	}
}

func TestNewWriterConfig(t *testing.T) {
	t.Parallel()
	_, err := outbox.NewWriter(outbox.Config{Schema: `bad"; DROP TABLE x; --`, MaxPayloadBytes: -1})
	if err == nil || !strings.Contains(err.Error(), "invalid schema name") || !strings.Contains(err.Error(), "MaxPayloadBytes is -1") {
		t.Fatalf("want both problems reported, got %v", err)
	}
	w, err := outbox.NewWriter(outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if c := w.Config(); c.Schema != "onceflow" || c.MaxPayloadBytes != 1<<20 {
		t.Fatalf("defaults = %+v", c)
	}
}

// TestNotifyOnlyWhileARelaySleeps: a write sends no NOTIFY while no relay is asleep (so busy
// writers never take PostgreSQL's commit-time notify lock); while one is, a write call sends
// exactly one, delivered on commit only.
func TestNotifyOnlyWhileARelaySleeps(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	listener, err := pgx.Connect(ctx, db.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Close(ctx)
	if _, err := listener.Exec(ctx, "LISTEN "+outbox.NotifyChannel(db.Schema)); err != nil {
		t.Fatal(err)
	}
	write := func(w *outbox.Writer, commit bool) {
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.WriteTx(ctx, tx, "t", outbox.NewMessage([]byte("x")), outbox.NewMessage([]byte("y"))); err != nil {
			t.Fatal(err)
		}
		if commit {
			err = tx.Commit(ctx)
		} else {
			err = tx.Rollback(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	none := func(what string) {
		t.Helper()
		short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		if n, err := listener.WaitForNotification(short); err == nil {
			t.Fatalf("%s: unexpected notification %+v", what, n)
		}
	}

	// No relay asleep: nothing is sent, and the writer stops asking for a while.
	write(newWriter(t, db, outbox.Config{}), true)
	none("no relay asleep")

	// A relay asleep: one notification per committed write call, none for a rollback. Each
	// writer is fresh, so it asks the database rather than trusting an earlier answer.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Schema+`.relay_member (id, expires_at, asleep_until) VALUES ('r', now() + interval '1 hour', now() + interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	write(newWriter(t, db, outbox.Config{}), false)
	w := newWriter(t, db, outbox.Config{})
	write(w, true)
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	n, err := listener.WaitForNotification(wctx)
	if err != nil {
		t.Fatalf("no notification after commit: %v", err)
	}
	if n.Channel != outbox.NotifyChannel(db.Schema) {
		t.Fatalf("channel %q", n.Channel)
	}
	none("a single write call")
	// While the relay sleeps, the writer keeps asking (and notifying) on every call.
	write(w, true)
	if _, err := listener.WaitForNotification(wctx); err != nil {
		t.Fatalf("second write while asleep: no notification: %v", err)
	}

	// DisableNotify never notifies.
	write(newWriter(t, db, outbox.Config{DisableNotify: true}), true)
	none("DisableNotify")
}

// TestWriteNeedsMigration: a schema without the wake-up function (migration 0003) fails the
// write with the command to run.
func TestWriteNeedsMigration(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	if _, err := db.Pool.Exec(ctx, `DROP FUNCTION `+db.Schema+`.outbox_wake(text)`); err != nil {
		t.Fatal(err)
	}
	w := newWriter(t, db, outbox.Config{})
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return w.WriteTx(ctx, tx, "t", outbox.NewMessage([]byte("x"))) })
	if err == nil || !strings.Contains(err.Error(), "onceflow migrate up") {
		t.Fatalf("write on an unmigrated schema: %v, want the command to run", err)
	}
}

type OrderPlaced struct {
	OrderID int `json:"order_id"`
}

// TestEventBusWritesIntoCallerTx shows the Watermill CQRS path: an EventBus built once on
// ContextPublisher writes into whatever transaction the publish context carries.
func TestEventBusWritesIntoCallerTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	w := newWriter(t, db, outbox.Config{})
	bus, err := cqrs.NewEventBusWithConfig(w.ContextPublisher(), cqrs.EventBusConfig{
		GeneratePublishTopic: func(p cqrs.GenerateEventPublishTopicParams) (string, error) { return "events." + p.EventName, nil },
		Marshaler:            cqrs.JSONMarshaler{NewUUID: outbox.NewUUID},
		OnPublish: func(p cqrs.OnEventSendParams) error {
			outbox.SetPartitionKey(p.Message, fmt.Sprint(p.Event.(*OrderPlaced).OrderID))
			return nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	publish := func(commit bool, id int) {
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := bus.Publish(outbox.ContextWithTx(ctx, tx), &OrderPlaced{OrderID: id}); err != nil {
			t.Fatal(err)
		}
		if commit {
			err = tx.Commit(ctx)
		} else {
			err = tx.Rollback(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	publish(false, 1)
	if got := readRows(t, db); len(got) != 0 {
		t.Fatalf("rolled back publish left %d rows", len(got))
	}
	publish(true, 2)
	got := readRows(t, db)
	if len(got) != 1 {
		t.Fatalf("got %d rows, want 1", len(got))
	}
	r := got[0]
	if r.Topic != "events.outbox_test.OrderPlaced" || string(r.Payload) != `{"order_id":2}` || r.Key != "2" || r.Metadata["name"] != "outbox_test.OrderPlaced" {
		t.Fatalf("row = %+v", r)
	}
	if uuid.MustParse(r.EventID).Version() != 7 {
		t.Fatalf("event id %s is not v7", r.EventID)
	}

	// Without a transaction in the context the bus refuses rather than writing outside one.
	if err := bus.Publish(ctx, &OrderPlaced{OrderID: 3}); !errors.Is(err, outbox.ErrNoTx) {
		t.Fatalf("publish without tx: %v, want ErrNoTx", err)
	}
}

func TestTxPublisher(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	w := newWriter(t, db, outbox.Config{})
	msg := outbox.NewMessage([]byte("via publisher"))
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		return w.TxPublisher(ctx, tx).Publish("t", msg)
	})
	if err != nil {
		t.Fatal(err)
	}
	got := readRows(t, db)
	if len(got) != 1 || got[0].EventID != msg.UUID {
		t.Fatalf("rows = %+v", got)
	}
}

// TestQueueWriteTx: the events queued into a batch with the business statement commit or roll
// back with it, in one round trip; a refused message queues nothing.
func TestQueueWriteTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, w := withOrders(t)
	send := func(id int, msgs ...*message.Message) (queued int, err error) {
		err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			b := &pgx.Batch{}
			b.Queue(`INSERT INTO `+db.Table("orders")+` VALUES ($1)`, id)
			if err := w.QueueWriteTx(ctx, b, "orders", msgs...); err != nil {
				queued = b.Len()
				return err
			}
			queued = b.Len()
			return tx.SendBatch(ctx, b).Close()
		})
		return queued, err
	}

	// The business statement fails (duplicate id): the queued events roll back with it.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("orders")+` VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	if _, err := send(1, outbox.NewMessage([]byte("lost"))); err == nil {
		t.Fatal("a batch whose business INSERT failed was sent without error")
	}
	if got := readRows(t, db); len(got) != 0 {
		t.Fatalf("a failed batch left %d outbox rows", len(got))
	}

	// A refused message: nothing of the call is queued, the error names it.
	n, err := send(2, outbox.NewMessage([]byte("ok")), outbox.NewMessage(nil))
	var ve *outbox.ValidationError
	if !errors.As(err, &ve) || ve.Index != 1 || n != 1 {
		t.Fatalf("err %v, %d statements queued; want a ValidationError for message 1 and only the business statement", err, n)
	}

	// Committed: the rows carry what was queued, in order.
	msgs := []*message.Message{
		outbox.SetPartitionKey(outbox.NewMessage([]byte(`{"n":1}`)), "order-3"),
		outbox.NewMessage([]byte(`{"n":2}`)),
	}
	if _, err := send(3, msgs...); err != nil {
		t.Fatal(err)
	}
	got := readRows(t, db)
	if len(got) != len(msgs) {
		t.Fatalf("got %d rows, want %d", len(got), len(msgs))
	}
	for i, m := range msgs {
		if got[i].EventID != m.UUID || string(got[i].Payload) != string(m.Payload) || got[i].Key != outbox.PartitionKey(m) {
			t.Errorf("row %d = %+v, want uuid %s payload %q key %q", i, got[i], m.UUID, m.Payload, outbox.PartitionKey(m))
		}
	}
}
