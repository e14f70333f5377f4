package adopttest

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/internal/testutil"
)

func TestMain(m *testing.M) { testdb.Main(m) }

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// buildOnceflow builds the onceflow binary of this checkout into a temporary folder.
func buildOnceflow(t *testing.T) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	root := filepath.Join(filepath.Dir(file), "..", "..")
	bin := filepath.Join(t.TempDir(), "onceflow")
	cmd := exec.Command("go", "build", "-race", "-o", bin, "./cmd/onceflow")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build onceflow: %v\n%s", err, out)
	}
	return bin
}

// event is the payload of the test's events: a per-key sequence number.
type event struct {
	Key string `json:"key"`
	Seq int    `json:"seq"`
}

// The end-to-end switch: 10,000 events written by watermill-sql's own publisher
// through Watermill's forwarder publisher (half of them while an unrelated transaction holds
// rows uncommitted, which stalls the real forwarder: it forwards nothing), the move refused
// while that forwarder runs, then run as `onceflow migrate from-forwarder` in a child process
// that is SIGKILLed midway and run again, then `onceflow relay` publishes to Kafka, and a
// consumer receives every event exactly once by UUID, in order per key, with its metadata.
func TestForwarderTableMovesToRelayExactlyOnce(t *testing.T) {
	const (
		total   = 10000
		perTx   = 10
		keys    = 37
		batch   = 50
		killAt  = 2000
		timeout = 3 * time.Minute
	)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 4)
	bin := buildOnceflow(t)
	suffix := randomHex(4)
	fwdTopic := "fwd_" + suffix // tables watermill_fwd_<suffix> and watermill_offsets_fwd_<suffix> in public
	topics := []string{"orders-" + suffix, "payments-" + suffix}
	t.Cleanup(func() {
		_, _ = db.Pool.Exec(context.Background(), fmt.Sprintf(`DROP TABLE IF EXISTS public."watermill_%s", public."watermill_offsets_%s", public."unrelated_%s"`, fwdTopic, fwdTopic, suffix))
	})

	producers, err := sql.Open("pgx", db.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer producers.Close()
	logger := watermill.NopLogger{}

	// The forwarder, as a service runs it: its own pool, the default schema and offsets
	// adapters, publishing to a Watermill publisher (here an in-memory one that counts).
	fwdDB, err := sql.Open("pgx", db.URL)
	if err != nil {
		t.Fatal(err)
	}
	fwdSub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(fwdDB), wsql.SubscriberConfig{
		SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{},
		InitializeSchema: true, PollInterval: 20 * time.Millisecond,
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	if err := fwdSub.SubscribeInitialize(fwdTopic); err != nil {
		t.Fatal(err)
	}

	// The unrelated transaction: it holds a row uncommitted (and so a transaction id) while
	// the first half of the events is written.
	if _, err := db.Pool.Exec(ctx, fmt.Sprintf(`CREATE TABLE public."unrelated_%s" (id int)`, suffix)); err != nil {
		t.Fatal(err)
	}
	foreign, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = foreign.Rollback(context.Background()) }()
	if _, err := foreign.Exec(ctx, fmt.Sprintf(`INSERT INTO public."unrelated_%s" VALUES (1)`, suffix)); err != nil {
		t.Fatal(err)
	}

	seq := map[string]int{}
	var ids []string
	write := func(from, to int) {
		t.Helper()
		for i := from; i < to; i += perTx {
			tx, err := producers.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			sqlPub, err := wsql.NewPublisher(wsql.TxFromStdSQL(tx), wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}}, logger)
			if err != nil {
				t.Fatal(err)
			}
			pub := forwarder.NewPublisher(sqlPub, forwarder.PublisherConfig{ForwarderTopic: fwdTopic})
			for j := i; j < i+perTx && j < to; j++ {
				k := fmt.Sprintf("acct-%d", j%keys)
				seq[k]++
				payload, _ := json.Marshal(event{Key: k, Seq: seq[k]})
				msg := message.NewMessage(watermill.NewUUID(), payload)
				msg.Metadata.Set("partition_key", k) // what the forwarder's Kafka marshaler used as the key
				msg.Metadata.Set("origin", "watermill-sql")
				ids = append(ids, msg.UUID)
				if err := pub.Publish(topics[(j%keys)%2], msg); err != nil {
					t.Fatal(err)
				}
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
		}
	}
	write(0, total/2)

	// The forwarder runs, stalled behind the unrelated transaction.
	var forwarded atomic.Int64
	fwd, err := forwarder.NewForwarder(fwdSub, gochannel.NewGoChannel(gochannel.Config{}, logger), logger, forwarder.Config{
		ForwarderTopic: fwdTopic, CloseTimeout: 5 * time.Second,
		Middlewares: []message.HandlerMiddleware{func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				forwarded.Add(1)
				return h(msg)
			}
		}},
	})
	if err != nil {
		t.Fatal(err)
	}
	fwdDone := make(chan error, 1)
	go func() { fwdDone <- fwd.Run(ctx) }()
	<-fwd.Running()
	// Wait until its subscriber has polled the offsets table, then the move must refuse.
	eventually(t, 30*time.Second, func() bool {
		var n int
		err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%watermill_offsets_'||$1||'%' AND pid <> pg_backend_pid()`, fwdTopic).Scan(&n)
		return err == nil && n > 0
	}, "the forwarder polls")
	out, err := exec.CommandContext(ctx, bin, "migrate", "from-forwarder", "--database-url", db.URL, "--schema", db.Schema,
		"--topic", fwdTopic, "--wait-open-transactions", "-1s").CombinedOutput()
	refused := string(out)
	if err == nil || !strings.Contains(refused, "still consumes") {
		t.Fatalf("the move did not refuse while the forwarder runs: %v\n%s", err, out)
	}
	t.Logf("refused while the forwarder runs: %s", strings.TrimSpace(refused))
	if err := fwd.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-fwdDone; err != nil {
		t.Fatal(err)
	}
	if err := fwdSub.Close(); err != nil { // the router does not close the subscriber it was given
		t.Fatal(err)
	}
	_ = fwdDB.Close() // a stopped forwarder's process has closed its connections
	var ackedOffset int64
	var ackedTx string
	if err := db.Pool.QueryRow(ctx, fmt.Sprintf(`SELECT offset_acked, last_processed_transaction_id::text FROM public."watermill_offsets_%s" WHERE consumer_group = ''`, fwdTopic)).Scan(&ackedOffset, &ackedTx); err != nil {
		t.Fatal(err)
	}
	var fxid string
	_ = foreign.QueryRow(ctx, `SELECT pg_current_xact_id()::text`).Scan(&fxid)
	t.Logf("forwarder stopped: forwarded %d, offset (%s, %d), foreign xid %s", forwarded.Load(), ackedTx, ackedOffset, fxid)
	if n := forwarded.Load(); n != 0 {
		t.Fatalf("the forwarder forwarded %d messages behind the open transaction; the test expects it stalled", n)
	}

	if err := foreign.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	write(total/2, total)

	move := func(args ...string) *exec.Cmd {
		cmd := exec.CommandContext(ctx, bin, append([]string{"migrate", "from-forwarder", "--database-url", db.URL, "--schema", db.Schema,
			"--topic", fwdTopic, "--batch-size", fmt.Sprint(batch)}, args...)...)
		cmd.Env = append(os.Environ(), "GORACE=halt_on_error=1")
		return cmd
	}
	var inTable, txs int
	if err := db.Pool.QueryRow(ctx, fmt.Sprintf(`SELECT count(*), count(DISTINCT transaction_id) FROM public."watermill_%s"`, fwdTopic)).Scan(&inTable, &txs); err != nil {
		t.Fatal(err)
	}
	t.Logf("forwarder table: %d rows from %d transactions", inTable, txs)
	out, err = move("--dry-run", "-v").CombinedOutput()
	if err != nil || !strings.Contains(string(out), fmt.Sprintf("would move %d messages", total)) {
		t.Fatalf("dry run: %v\n%s", err, out)
	}
	t.Logf("dry run: %s", out)

	// The move, SIGKILLed midway.
	outboxCount := func() int {
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Table("outbox")).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	var childOut testutil.SyncBuffer
	child := move("-v")
	child.Stdout, child.Stderr = &childOut, &childOut
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	childDone := make(chan error, 1)
	go func() { childDone <- child.Wait() }()
	for outboxCount() < killAt {
		select {
		case err := <-childDone:
			t.Fatalf("the move ended (%v) before it could be killed:\n%s", err, childOut.String())
		case <-time.After(2 * time.Millisecond): // polling the outbox: the child gives no signal
		}
	}
	_ = child.Process.Signal(syscall.SIGKILL)
	<-childDone
	mid := outboxCount()
	var offset int64
	if err := db.Pool.QueryRow(ctx, fmt.Sprintf(`SELECT offset_acked FROM public."watermill_offsets_%s" WHERE consumer_group = ''`, fwdTopic)).Scan(&offset); err != nil {
		t.Fatal(err)
	}
	t.Logf("killed with %d rows moved (forwarder offset %d)", mid, offset)
	if mid%batch != 0 || mid >= total {
		t.Fatalf("after the kill the outbox holds %d rows: not whole batches of %d", mid, batch)
	}

	out, err = move().CombinedOutput()
	if err != nil || !strings.Contains(string(out), fmt.Sprintf("moved %d messages", total-mid)) {
		t.Fatalf("rerun: %v\n%s", err, out)
	}
	t.Logf("rerun: %s", out)
	// The way back is the first run's starting point, whatever was killed in between.
	if !strings.Contains(string(out), "SET offset_acked = 0, last_processed_transaction_id = '0'") ||
		!strings.Contains(string(out), fmt.Sprintf("over every run: %d messages", total)) {
		t.Fatalf("rerun does not report the first run's start and the total:\n%s", out)
	}
	var rows, distinct int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT event_id) FROM `+db.Table("outbox")).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	if rows != total || distinct != total {
		t.Fatalf("outbox: %d rows, %d distinct event ids; want %d", rows, distinct, total)
	}
	if out, err := move().CombinedOutput(); err != nil || !strings.Contains(string(out), "moved 0 messages") {
		t.Fatalf("a third run moved something: %v\n%s", err, out)
	}

	// The relay publishes; a consumer reads both topics.
	var relayOut testutil.SyncBuffer
	relay := exec.CommandContext(ctx, bin, "relay", "--database-url", db.URL, "--schema", db.Schema,
		"--kafka-brokers", strings.Join(brokers, ","), "--id", "adopt-relay")
	relay.Stdout, relay.Stderr = &relayOut, &relayOut
	if err := relay.Start(); err != nil {
		t.Fatal(err)
	}
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Wait() }()
	defer func() {
		_ = relay.Process.Signal(syscall.SIGTERM)
		<-relayDone
		if t.Failed() {
			t.Logf("relay output:\n%s", relayOut.String())
		}
	}()
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topics...), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	seen := map[string]int{}
	last := map[string]int{}
	for len(seen) < total {
		fetches := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			t.Fatalf("received %d of %d events before the deadline", len(seen), total)
		}
		fetches.EachError(func(topic string, p int32, err error) { t.Logf("fetch %s/%d: %v", topic, p, err) })
		fetches.EachRecord(func(r *kgo.Record) {
			var id, origin string
			for _, h := range r.Headers {
				switch h.Key {
				case "_watermill_message_uuid":
					id = string(h.Value)
				case "origin":
					origin = string(h.Value)
				}
			}
			seen[id]++
			var e event
			if err := json.Unmarshal(r.Value, &e); err != nil {
				t.Fatalf("record %s: %v", id, err)
			}
			if string(r.Key) != e.Key || origin != "watermill-sql" {
				t.Fatalf("record %s: key %q, origin %q; want key %q, origin watermill-sql", id, r.Key, origin, e.Key)
			}
			if e.Seq != last[e.Key]+1 {
				t.Fatalf("key %s: seq %d after %d (out of order or a gap)", e.Key, e.Seq, last[e.Key])
			}
			last[e.Key] = e.Seq
		})
	}
	for _, id := range ids {
		if seen[id] != 1 {
			t.Fatalf("event %s received %d times", id, seen[id])
		}
	}
	if len(seen) != total {
		t.Fatalf("received %d distinct ids, want %d", len(seen), total)
	}
}

// eventually polls cond until it holds or the timeout passes.
func eventually(t *testing.T, timeout time.Duration, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out: %s", what)
		}
		time.Sleep(50 * time.Millisecond) // polling: the condition has no signal to wait for
	}
}
