package inboxkafka_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/engine"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/outbox"
)

// childEnv makes this test binary a batched consumer process (childMain); CHILD_* carry its
// settings.
const childEnv = "ONCEFLOW_INBOXKAFKA_BATCH_TEST_CHILD"

// childMain is a consumer service on the batched consumer: each message's effect is one row.
// CHILD_KILL says where it SIGKILLs itself:
//
//	mid-batch:N     in the handler of its N-th message, with earlier messages of the same
//	                transaction already written (so a batch dies half applied)
//	after-commit:N  right after the batch holding its N-th message committed, before its
//	                offsets are marked or committed
//
// It prints "APPLIED <n>" after each committed batch and "KILL" before it dies.
func childMain() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "child:", err); return 1 }
	schema := os.Getenv("CHILD_SCHEMA")
	pool, err := pgxpool.New(ctx, os.Getenv("CHILD_DB_URL"))
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	ib, err := inbox.New(inbox.Config{Pool: pool, Schema: schema, Consumer: "batch-kill", Logger: log})
	if err != nil {
		return fail(err)
	}
	mode, nStr, _ := strings.Cut(os.Getenv("CHILD_KILL"), ":")
	killAt, _ := strconv.Atoi(nStr)
	var handled atomic.Int64
	effect := `INSERT INTO ` + pgxIdent(schema) + `.effect (msg_uuid, k, seq) VALUES ($1, $2, $3)`
	die := func() {
		fmt.Println("KILL")
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
	hold := os.Getenv("CHILD_LANE") == "hold"
	p := ib.Batch("", func(msg *message.Message) ([]*message.Message, error) {
		seq, _ := strconv.Atoi(msg.Metadata.Get("seq"))
		if hold && msg.Metadata.Get("k") == "k0" && seq == 1 {
			// CHILD_LANE=hold: key k0's first message keeps asking for later (the retry lane).
			return nil, inbox.RetryAfter(errors.New("provider down"), 300*time.Millisecond)
		}
		if _, err := outbox.MustTx(msg.Context()).Exec(msg.Context(), effect, msg.UUID, msg.Metadata.Get("k"), seq); err != nil {
			return nil, err
		}
		if n := handled.Add(1); mode == "mid-batch" && n == int64(killAt) {
			die()
		}
		return nil, nil
	})
	var applied atomic.Int64
	proc := afterCommit{BatchProcessor: p, after: func(n int) {
		total := applied.Add(int64(n))
		if mode == "after-commit" && total >= int64(killAt) {
			die()
		}
		fmt.Println("APPLIED", total)
	}}
	c, err := inboxkafka.NewBatchConsumer(inboxkafka.BatchConfig{
		Brokers: strings.Split(os.Getenv("CHILD_BROKERS"), ","), Group: os.Getenv("CHILD_GROUP"), Topics: []string{os.Getenv("CHILD_TOPIC")},
		Processor: afterCommitLane{proc, p.(lane)}, MaxBatch: 50, Logger: log,
		// Short sessions so a killed member leaves the group quickly; the test's kfake allows them.
		ClientOpts: []kgo.Opt{kgo.SessionTimeout(2 * time.Second), kgo.HeartbeatInterval(200 * time.Millisecond), kgo.RebalanceTimeout(4 * time.Second)},
	})
	if err != nil {
		return fail(err)
	}
	if err := c.Run(ctx); err != nil {
		return fail(err)
	}
	return 0
}

// afterCommit calls after with the batch's size once ProcessBatch committed.
type afterCommit struct {
	inbox.BatchProcessor
	after func(n int)
}

func (a afterCommit) ProcessBatch(ctx context.Context, msgs []*message.Message) error {
	err := a.BatchProcessor.ProcessBatch(ctx, msgs)
	if err == nil {
		a.after(len(msgs))
	}
	return err
}

// lane is the retry lane of an inbox's batch processor.
type lane interface {
	engine.Parker
	engine.LaneDrainer
}

// afterCommitLane is afterCommit with the wrapped processor's retry lane: a wrapper that does
// not forward it leaves the consumer without one.
type afterCommitLane struct {
	afterCommit
	lane
}

func pgxIdent(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }

// startKChild starts this test binary as a batched consumer process (childMain).
func startKChild(t *testing.T, env []string) *testutil.Child {
	t.Helper()
	return testutil.StartChild(t, append([]string{childEnv + "=consumer"}, env...), func(string) {})
}

// A consumer process SIGKILLed in the middle of a batch (half of its writes done, nothing
// committed) and another killed right after a batch committed but before its offsets were
// committed: after restarts under new member ids, every message is applied exactly once and
// each key in order.
func TestBatchConsumerKilledMidBatch(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	if _, err := db.Pool.Exec(context.Background(), `CREATE TABLE `+db.Table("effect")+
		` (id bigserial PRIMARY KEY, msg_uuid text NOT NULL, k text NOT NULL DEFAULT '', seq int NOT NULL DEFAULT 0)`); err != nil {
		t.Fatal(err)
	}
	k := kafkatest.Fake(t, 2, kfake.GroupMinSessionTimeout(500*time.Millisecond))
	f := &bfix{t: t, db: db, brokers: k.Brokers(), topic: kafkatest.Topic("kill")}
	msgs := f.produce(1500, 30)
	env := []string{"CHILD_DB_URL=" + db.URL, "CHILD_SCHEMA=" + db.Schema, "CHILD_TOPIC=" + f.topic,
		"CHILD_GROUP=" + kafkatest.Topic("g"), "CHILD_BROKERS=" + strings.Join(k.Brokers(), ",")}
	for i, kill := range []string{"mid-batch:425", "after-commit:400"} {
		c := startKChild(t, append(env, "CHILD_KILL="+kill))
		c.WaitExit(t, 2*time.Minute)
		if !c.KilledBySIGKILL() {
			t.Fatalf("child %d (%s) was not killed: %v\n%s", i, kill, c.Cmd.ProcessState, c.Stderr.String())
		}
		if n := f.count(`SELECT count(*) FROM (SELECT msg_uuid FROM ` + db.Table("effect") + ` GROUP BY 1 HAVING count(*) > 1) d`); n != 0 {
			t.Fatalf("after kill %q: %d messages applied twice", kill, n)
		}
	}
	applied := f.count(`SELECT count(*) FROM ` + db.Table("effect"))
	if applied == 0 || applied >= len(msgs) {
		t.Fatalf("%d of %d applied before the last restart; the kills should have stopped midway", applied, len(msgs))
	}
	last := startKChild(t, env)
	f.waitEffects(len(msgs))
	if err := last.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	last.WaitExit(t, 2*time.Minute)
	if code := last.Cmd.ProcessState.ExitCode(); code != 0 {
		t.Fatalf("last child exited %d:\n%s", code, last.Stderr.String())
	}
	f.checkOnceInOrder(msgs)
}

// A second consumer joins the group while the first is in the middle of its batches, then
// leaves again: partitions move twice, each only after its batch in flight committed, and
// every message is applied once, in order per key.
func TestBatchConsumerRebalanceMidBatch(t *testing.T) {
	t.Parallel()
	f := newBatchFixture(t, 4)
	msgs := f.produce(2000, 40)
	var handled atomic.Int64
	p := f.ib.Batch("", func(msg *message.Message) ([]*message.Message, error) {
		handled.Add(1)
		time.Sleep(200 * time.Microsecond) // slow enough that batches are in flight when the group changes
		return nil, f.effect(msg)
	})
	group := kafkatest.Topic("g")
	opts := func(c *inboxkafka.BatchConfig) {
		c.MaxBatch = 50
		c.ClientOpts = []kgo.Opt{kgo.SessionTimeout(6 * time.Second), kgo.RebalanceTimeout(10 * time.Second)}
	}
	f.start(group, p, opts)
	waitCount(t, &handled, 300)
	stopB := f.start(group, p, opts) // joins: some partitions move to it
	waitCount(t, &handled, 1000)
	stopB() // leaves: they move back
	f.waitEffects(len(msgs))
	f.checkOnceInOrder(msgs)
}

func waitCount(t *testing.T, n *atomic.Int64, want int64) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for n.Load() < want {
		if time.Now().After(deadline) {
			t.Fatalf("only %d of %d after 90 s", n.Load(), want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
