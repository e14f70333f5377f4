package hatest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
	"github.com/onceflow/onceflow/saga"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// world is one failover test: a primary and a standby, and on their multi-host URL the
// writers, a relay, a batched inbox consumer, saga starters, two participants and the
// orchestrator, each on a pool of its own (as separate services would be).
type world struct {
	t    *testing.T
	pair *testdb.Pair
	db   *testdb.DB
	// reads is the pool of the test's own queries (count, queryIDs): db.Pool until a
	// promotion, then a pool opened after it (promoted), so that no test query meets a
	// connection to the dead primary; meeting those is the components' job, not the test's.
	reads   *pgxpool.Pool
	brokers []string
	topic   string // the writers' events
	def     *saga.Definition[order]
	suffix  string // of the saga's topics, unique per test

	ctx    context.Context // cancelled by stop
	cancel context.CancelFunc
	runs   []chan error

	mu      sync.Mutex
	writes  []write // every write attempt whose COMMIT was sent
	sagas   []start // every saga start whose COMMIT was sent
	running atomic.Bool
	loaders sync.WaitGroup
}

// write is one business transaction of a writer: a ledger row (the business write, keyed by
// event id) and its outbox event, committed together.
type write struct {
	EventID string
	Key     string
	Seq     int   // the key's sequence number, from the key's row (serialises the key)
	Err     error // COMMIT's error: nil = acknowledged; else the outcome is unknown
}

// start is one saga start (saga.StartTx in a business transaction).
type start struct {
	ID  string
	Err error // COMMIT's error
}

type order struct {
	ID string `json:"id"`
}

type stepCmd struct {
	ID string `json:"id"`
}

type stepResult struct {
	Done string `json:"done"`
}

var stepNames = []string{"reserve", "charge"}

// newWorld starts the pair; stepTimeout is the saga steps' Timeout (0: none).
func newWorld(t *testing.T, sync bool, stepTimeout time.Duration) *world {
	t.Helper()
	pair, db := testdb.NewPair(t, sync)
	w := &world{t: t, pair: pair, db: db, reads: db.Pool, brokers: kafkatest.Brokers(t, 4), topic: kafkatest.Topic("ha-events")}
	w.suffix = w.topic[len("ha-events-"):]
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `
		CREATE TABLE `+db.Table("key_seq")+` (key text PRIMARY KEY, seq int NOT NULL);
		CREATE TABLE `+db.Table("ledger")+` (event_id uuid PRIMARY KEY, key text NOT NULL, seq int NOT NULL);
		CREATE TABLE `+db.Table("effect")+` (n bigserial PRIMARY KEY, event_id uuid NOT NULL, key text NOT NULL, seq int NOT NULL);
		CREATE TABLE `+db.Table("saga_effect")+` (n bigserial PRIMARY KEY, saga text NOT NULL, step text NOT NULL, phase text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	var steps []*saga.StepDef[order]
	for _, name := range stepNames {
		s := saga.Step[order](name).
			Send(w.sagaTopic("cmd", name), func(o order) (any, error) { return stepCmd(o), nil }).
			OnReply(func(*order, saga.Reply) error { return nil }).
			Compensate(w.sagaTopic("undo", name), func(o order) (any, error) { return stepCmd(o), nil }).
			Attempts(5, 50*time.Millisecond)
		if stepTimeout > 0 {
			s.Timeout(stepTimeout)
		}
		steps = append(steps, s)
	}
	def, err := saga.Define("ha-checkout", 1, steps, saga.WithReplyTopic(w.sagaTopic("reply", "checkout")))
	if err != nil {
		t.Fatal(err)
	}
	w.def = def
	w.ctx, w.cancel = context.WithCancel(context.Background())
	t.Cleanup(w.stop)
	return w
}

func (w *world) sagaTopic(kind, name string) string { return kind + "." + name + "." + w.suffix }

// promoted is called once the standby is the primary: the test's own queries move to a new pool.
func (w *world) promoted() { w.reads = w.pool(2) }

// pool is a component's own pool on the multi-host URL.
func (w *world) pool(maxConns int32) *pgxpool.Pool {
	w.t.Helper()
	cfg, err := pgxpool.ParseConfig(w.pair.URL)
	if err != nil {
		w.t.Fatal(err)
	}
	cfg.MaxConns = maxConns
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		w.t.Fatal(err)
	}
	w.t.Cleanup(p.Close)
	return p
}

func logger() *slog.Logger {
	level := slog.LevelError
	if os.Getenv("HATEST_LOG") != "" {
		level = slog.LevelInfo
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
}

func (w *world) goRun(run func(context.Context) error) {
	ch := make(chan error, 1)
	go func() { ch <- run(w.ctx) }()
	w.runs = append(w.runs, ch)
}

// stop ends every component and fails the test if one returned an error.
func (w *world) stop() {
	w.running.Store(false)
	w.loaders.Wait()
	w.cancel()
	for _, ch := range w.runs {
		if err := <-ch; err != nil && !errors.Is(err, context.Canceled) {
			w.t.Errorf("component stopped with: %v", err)
		}
	}
	w.runs = nil
}

// startComponents starts the relay, the effect consumer, the participants and the
// orchestrator.
func (w *world) startComponents() {
	t := w.t
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: w.brokers})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sink.Close() })
	r, err := relay.New(relay.Config{Pool: w.pool(4), Sink: sink, Schema: w.db.Schema, PollInterval: 20 * time.Millisecond, Logger: logger()})
	if err != nil {
		t.Fatal(err)
	}
	w.goRun(r.Run)

	consume := func(group string, p inbox.BatchProcessor, topics ...string) {
		c, err := inboxkafka.NewBatchConsumer(inboxkafka.BatchConfig{Brokers: w.brokers, Group: group, Topics: topics, Processor: p,
			Backoff: 10 * time.Millisecond, MaxBackoff: 200 * time.Millisecond, Logger: logger()})
		if err != nil {
			t.Fatal(err)
		}
		w.goRun(c.Run)
	}
	// The effect consumer: one effect row per event, in the transaction of its dedup row.
	effPool := w.pool(6)
	ib, err := inbox.New(inbox.Config{Pool: effPool, Schema: w.db.Schema, Consumer: "effects", Logger: logger()})
	if err != nil {
		t.Fatal(err)
	}
	consume("effects", ib.BatchNoPublish(func(msg *message.Message) error {
		var ev event
		if err := json.Unmarshal(msg.Payload, &ev); err != nil {
			return err
		}
		_, err := outbox.MustTx(msg.Context()).Exec(msg.Context(), `INSERT INTO `+w.db.Table("effect")+` (event_id, key, seq) VALUES ($1, $2, $3)`,
			msg.UUID, ev.Key, ev.Seq)
		return err
	}), w.topic)

	for _, name := range stepNames {
		p, err := saga.NewParticipant(saga.ParticipantConfig{Pool: w.pool(4), Schema: w.db.Schema, Consumer: "svc-" + name, Logger: logger()})
		if err != nil {
			t.Fatal(err)
		}
		consume("svc-"+name, saga.ActionProcessor(p, w.sagaEffect(name, "action")), w.sagaTopic("cmd", name))
		consume("undo-"+name, saga.CompensationProcessor(p, func(ctx context.Context, tx pgx.Tx, cmd stepCmd) error {
			_, err := w.sagaEffect(name, "compensation")(ctx, tx, cmd)
			return err
		}), w.sagaTopic("undo", name))
	}
	o, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: w.pool(6), Schema: w.db.Schema, TimerInterval: 20 * time.Millisecond, Logger: logger()})
	if err != nil {
		t.Fatal(err)
	}
	if err := saga.Register(o, w.def); err != nil {
		t.Fatal(err)
	}
	w.goRun(o.Run)
	consume("orchestrator", o, o.ReplyTopics()...)
}

func (w *world) sagaEffect(step, phase string) func(ctx context.Context, tx pgx.Tx, cmd stepCmd) (stepResult, error) {
	return func(ctx context.Context, tx pgx.Tx, cmd stepCmd) (stepResult, error) {
		_, err := tx.Exec(ctx, `INSERT INTO `+w.db.Table("saga_effect")+` (saga, step, phase) VALUES ($1, $2, $3)`, cmd.ID, step, phase)
		return stepResult{Done: step}, err
	}
}

// event is a writer's payload.
type event struct {
	Key string `json:"key"`
	Seq int    `json:"seq"`
}

// startLoad starts writers (keys k-<writer>-<n>, one transaction per event: the key's row is
// incremented, which serialises the key's writers, a ledger row and the outbox event) and a
// saga starter. They run until stopLoad, retrying through the outage.
func (w *world) startLoad(writers, keysPerWriter int) {
	w.running.Store(true)
	ow, err := outbox.NewWriter(outbox.Config{Schema: w.db.Schema})
	if err != nil {
		w.t.Fatal(err)
	}
	pool := w.pool(int32(writers + 2))
	// Transactions run on a context that is never cancelled: cancelling one during COMMIT
	// would make its outcome unknown for a reason of the test's own.
	ctx := context.Background()
	for i := range writers {
		w.loaders.Add(1)
		go func() {
			defer w.loaders.Done()
			for n := 0; w.running.Load(); n++ {
				key := "k-" + strconv.Itoa(i) + "-" + strconv.Itoa(n%keysPerWriter)
				w.writeOne(ctx, pool, ow, key)
			}
		}()
	}
	w.loaders.Add(1)
	go func() {
		defer w.loaders.Done()
		for n := 0; w.running.Load(); n++ {
			w.startSaga(ctx, pool, ow, "s-"+strconv.Itoa(n))
			time.Sleep(5 * time.Millisecond)
		}
	}()
}

func (w *world) stopLoad() {
	w.running.Store(false)
	w.loaders.Wait()
}

func (w *world) writeOne(ctx context.Context, pool *pgxpool.Pool, ow *outbox.Writer, key string) {
	tx, err := pool.Begin(ctx)
	if err != nil {
		time.Sleep(10 * time.Millisecond) // no server yet: nothing was written
		return
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var seq int
	if err := tx.QueryRow(ctx, `INSERT INTO `+w.db.Table("key_seq")+` (key, seq) VALUES ($1, 1)
		ON CONFLICT (key) DO UPDATE SET seq = key_seq.seq + 1 RETURNING seq`, key).Scan(&seq); err != nil {
		return
	}
	payload, _ := json.Marshal(event{Key: key, Seq: seq})
	m := outbox.SetPartitionKey(outbox.NewMessage(payload), key)
	if _, err := tx.Exec(ctx, `INSERT INTO `+w.db.Table("ledger")+` (event_id, key, seq) VALUES ($1, $2, $3)`, m.UUID, key, seq); err != nil {
		return
	}
	if err := ow.WriteTx(ctx, tx, w.topic, m); err != nil {
		return
	}
	err = tx.Commit(ctx)
	w.mu.Lock()
	w.writes = append(w.writes, write{EventID: m.UUID, Key: key, Seq: seq, Err: err})
	w.mu.Unlock()
}

func (w *world) startSaga(ctx context.Context, pool *pgxpool.Pool, ow *outbox.Writer, id string) {
	tx, err := pool.Begin(ctx)
	if err != nil {
		time.Sleep(10 * time.Millisecond)
		return
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := saga.StartTx(ctx, tx, w.def, order{ID: id}, saga.WithID(id), saga.WithWriter(ow)); err != nil {
		return
	}
	err = tx.Commit(ctx)
	w.mu.Lock()
	w.sagas = append(w.sagas, start{ID: id, Err: err})
	w.mu.Unlock()
}

func (w *world) counts() (writes, sagas int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.writes), len(w.sagas)
}

// waitFor polls cond every 20ms until it holds or limit passes; it returns how long it took
// and whether it held.
func waitFor(limit time.Duration, cond func() bool) (time.Duration, bool) {
	t0 := time.Now()
	for {
		if cond() {
			return time.Since(t0), true
		}
		if time.Since(t0) > limit {
			return time.Since(t0), false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// record is one Kafka record of the events topic.
type record struct {
	EventID   string
	Key       string
	Seq       int
	Partition int32
	Offset    int64
}

// readTopic reads every record of the events topic from the start (until a poll finds
// nothing new for a second).
func (w *world) readTopic() []record {
	w.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.ConsumeTopics(w.topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(200*time.Millisecond))
	if err != nil {
		w.t.Fatal(err)
	}
	defer cl.Close()
	var out []record
	idle := 0
	for idle < 5 {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		fs := cl.PollFetches(ctx)
		cancel()
		n := 0
		fs.EachRecord(func(r *kgo.Record) {
			n++
			var ev event
			_ = json.Unmarshal(r.Value, &ev)
			rec := record{Key: string(r.Key), Seq: ev.Seq, Partition: r.Partition, Offset: r.Offset}
			for _, h := range r.Headers {
				if h.Key == relaykafka.UUIDHeader {
					rec.EventID = string(h.Value)
				}
			}
			out = append(out, rec)
		})
		if n == 0 {
			idle++
		} else {
			idle = 0
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Partition != out[j].Partition {
			return out[i].Partition < out[j].Partition
		}
		return out[i].Offset < out[j].Offset
	})
	return out
}

// queryIDs returns the first column of sql's rows as a set.
func (w *world) queryIDs(sql string) map[string]bool {
	w.t.Helper()
	rows, err := w.reads.Query(context.Background(), sql)
	if err != nil {
		w.t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		w.t.Fatal(err)
	}
	set := make(map[string]bool, len(ids))
	for _, id := range ids {
		set[id] = true
	}
	return set
}

func (w *world) count(sql string) int {
	w.t.Helper()
	var n int
	if err := w.reads.QueryRow(context.Background(), sql).Scan(&n); err != nil {
		w.t.Fatal(err)
	}
	return n
}

// figures is what a failover cost, as measured after it.
type figures struct {
	Acked, Unknown        int // writes whose COMMIT returned nil / an error
	UnknownCommitted      int // of Unknown: found on the new primary
	LostAcked             int // acknowledged writes missing on the new primary
	LostAckedPublished    int // of LostAcked: in Kafka all the same (published from the old primary)
	MissingFromKafka      int // on the new primary (ledger) but never published
	Invented              int // in Kafka, not on the new primary (= published rows the new primary lost)
	Duplicates            int // Kafka records repeating an event id
	SeqReused             int // Kafka records whose key and seq an earlier record with another id had
	OrderBroken           int // Kafka records whose seq went backwards, not a re-delivery nor a reuse
	DoubleEffects         int // event ids with more than one effect row
	LedgerWithoutEffect   int // new primary's events without an effect (the effect's commit was lost, Kafka offset committed)
	EffectsOfInvented     int // effect rows on the new primary for invented events
	SagasAcked, SagasLost int // saga starts acknowledged / of them missing on the new primary
	SagasUnfinished       int
	SagaDoubleEffects     int // (saga, step, phase) applied more than once on the new primary
	OutboxLeft            int
	// Times from the promotion (and from the end of the load) until the outbox was empty
	// (a row leaves it only once the broker acknowledged it), every saga finished, every
	// event of the new primary had its effect; 0 = not within the wait.
	DrainAfterPromote, DrainAfterLoad time.Duration
	SagasFinishedAfterPromote         time.Duration
	EffectsAfterPromote               time.Duration
}

func (f figures) String() string {
	type plain figures // without this method
	return fmt.Sprintf("%+v", plain(f))
}
