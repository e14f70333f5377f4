package inbox_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/outbox"
)

// childEnv selects the consumer mode of this test binary; the other CHILD_* variables carry
// its settings.
const childEnv = "ONCEFLOW_INBOX_TEST_CHILD"

// childMain is a consumer service: a watermill-kafka subscriber configured by inboxkafka, a
// router, the inbox and a handler inserting one effect row. It reports on stdout:
//
//	DONE <uuid> duplicate=<bool>   the inbox returned success (committed, or skipped)
//
// and, when CHILD_KILL says so, SIGKILLs itself at the named point for the named message:
//
//	after-commit:<uuid>  after the inbox transaction committed, before the router acks
//	                     (so before watermill-kafka marks and commits the offset)
//	in-handler:<uuid>    after the handler's write, before the inbox commits
func childMain(string) int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "child:", err); return 1 }
	schema := os.Getenv("CHILD_SCHEMA")
	pcfg, err := pgxpool.ParseConfig(os.Getenv("CHILD_DB_URL"))
	if err != nil {
		return fail(err)
	}
	pcfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	counters := &inbox.Counters{}
	ib, err := inbox.New(inbox.Config{Pool: pool, Schema: schema, Consumer: "kill-test", Metrics: counters,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, nil))})
	if err != nil {
		return fail(err)
	}
	killMode, killUUID, _ := strings.Cut(os.Getenv("CHILD_KILL"), ":")
	var outMu sync.Mutex
	say := func(format string, args ...any) {
		outMu.Lock()
		defer outMu.Unlock()
		fmt.Fprintf(os.Stdout, format+"\n", args...)
	}
	die := func(msg *message.Message, where string) {
		say("KILL %s %s", where, msg.UUID)
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // never returns: nothing after this point may run
	}

	scfg := inboxkafka.SubscriberConfig(strings.Split(os.Getenv("CHILD_BROKERS"), ","), os.Getenv("CHILD_GROUP"))
	// Short sessions so a killed member leaves the group quickly; the test's kfake allows them.
	scfg.OverwriteSaramaConfig.Consumer.Group.Session.Timeout = 3 * time.Second
	scfg.OverwriteSaramaConfig.Consumer.Group.Heartbeat.Interval = 500 * time.Millisecond
	wlog := watermill.NewSlogLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	sub, err := kafka.NewSubscriber(scfg, wlog)
	if err != nil {
		return fail(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, wlog)
	if err != nil {
		return fail(err)
	}
	report := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			before := counters.Snapshot().Duplicates
			out, err := h(msg)
			if err == nil {
				if killMode == "after-commit" && msg.UUID == killUUID {
					die(msg, "after-commit")
				}
				say("DONE %s duplicate=%v", msg.UUID, counters.Snapshot().Duplicates > before)
			}
			return out, err
		}
	}
	router.AddMiddleware(report, ib.Middleware)
	router.AddConsumerHandler("kill-test", os.Getenv("CHILD_TOPIC"), sub, func(msg *message.Message) error {
		if _, err := outbox.MustTx(msg.Context()).Exec(msg.Context(), `INSERT INTO effect (msg_uuid, note) VALUES ($1, $2)`, msg.UUID, fmt.Sprint(os.Getpid())); err != nil {
			return err
		}
		if killMode == "in-handler" && msg.UUID == killUUID {
			die(msg, "in-handler")
		}
		return nil
	})
	if err := router.Run(ctx); err != nil {
		return fail(err)
	}
	return 0
}

// child is a running consumer process and the lines it printed.
type child struct {
	*testutil.Child
	lines chan string
}

func startChild(t *testing.T, env []string) *child {
	t.Helper()
	c := &child{lines: make(chan string, 100)}
	c.Child = testutil.StartChild(t, append([]string{childEnv + "=consumer"}, env...), func(line string) { c.lines <- line })
	return c
}

// await returns the first line starting with prefix, failing the test if the child exits or
// a generous deadline passes first.
func (c *child) await(t *testing.T, prefix string) string {
	t.Helper()
	deadline := time.After(2 * time.Minute)
	for {
		select {
		case line := <-c.lines:
			if strings.HasPrefix(line, prefix) {
				return line
			}
		case <-c.Exited:
			select {
			case line := <-c.lines: // printed before it exited
				if strings.HasPrefix(line, prefix) {
					return line
				}
				continue
			default:
			}
			t.Fatalf("child exited before printing %q; stderr:\n%s", prefix, c.Stderr.String())
		case <-deadline:
			t.Fatalf("no %q from the child; stderr:\n%s", prefix, c.Stderr.String())
		}
	}
}

// End to end on the Kafka protocol (kfake) with watermill-kafka: a consumer process killed
// after the inbox committed but before its offset commit gets the message again on restart
// and skips it; one killed before the commit applies it on restart. Each effect exists once.
func TestKafkaConsumerKilledAroundCommit(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	createEffectTable(t, db)
	f := &fixture{t: t, db: db}
	k := kafkatest.Fake(t, 1, kfake.GroupMinSessionTimeout(time.Second))
	topic, group := kafkatest.Topic("orders"), kafkatest.Topic("billing")
	env := []string{
		"CHILD_DB_URL=" + db.URL, "CHILD_SCHEMA=" + db.Schema, "CHILD_TOPIC=" + topic, "CHILD_GROUP=" + group,
		"CHILD_BROKERS=" + strings.Join(k.Brokers(), ","),
	}
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: k.Brokers(), Marshaler: kafka.DefaultMarshaler{}}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	publish := func() string {
		t.Helper()
		msg := outbox.NewMessage([]byte(`{"order":1}`))
		if err := pub.Publish(topic, msg); err != nil {
			t.Fatal(err)
		}
		return msg.UUID
	}
	dedupRow := func(uuid string) int {
		return f.count(`SELECT count(*) FROM `+f.db.Table("processed_event")+` WHERE consumer = 'kill-test' AND dedup_key = $1`, "event:"+uuid)
	}

	// 1. Killed right after the inbox commit, before the ack: the effect is durable, the
	// offset is not committed.
	m1 := publish()
	c1 := startChild(t, append(env, "CHILD_KILL=after-commit:"+m1))
	c1.await(t, "KILL after-commit "+m1)
	c1.WaitExit(t, 2*time.Minute)
	if !c1.KilledBySIGKILL() {
		t.Fatalf("child 1 was not killed: %v\n%s", c1.Cmd.ProcessState, c1.Stderr.String())
	}
	if f.effects(m1) != 1 || dedupRow(m1) != 1 {
		t.Fatalf("after the kill: effects %d, dedup rows %d; want the committed transaction", f.effects(m1), dedupRow(m1))
	}

	// 2. Restart: Kafka redelivers m1 (its offset was never committed) and the inbox skips it.
	c2 := startChild(t, env)
	if line := c2.await(t, "DONE "+m1); line != "DONE "+m1+" duplicate=true" {
		t.Fatalf("redelivered m1: %q, want it skipped as a duplicate", line)
	}
	m2 := publish()
	if line := c2.await(t, "DONE "+m2); line != "DONE "+m2+" duplicate=false" {
		t.Fatalf("m2: %q", line)
	}
	if err := c2.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	c2.WaitExit(t, 2*time.Minute)
	if code := c2.Cmd.ProcessState.ExitCode(); code != 0 {
		t.Fatalf("child 2 exited %d after SIGTERM:\n%s", code, c2.Stderr.String())
	}

	// 3. Killed inside the handler, before the commit: nothing of the attempt survives...
	m3 := publish()
	c3 := startChild(t, append(env, "CHILD_KILL=in-handler:"+m3))
	c3.await(t, "KILL in-handler "+m3)
	c3.WaitExit(t, 2*time.Minute)
	if !c3.KilledBySIGKILL() {
		t.Fatalf("child 3 was not killed: %v", c3.Cmd.ProcessState)
	}
	if f.effects(m3) != 0 || dedupRow(m3) != 0 {
		t.Fatalf("killed before commit: effects %d, dedup rows %d; want none", f.effects(m3), dedupRow(m3))
	}
	// ...and the restarted consumer applies the redelivered message.
	c4 := startChild(t, env)
	if line := c4.await(t, "DONE "+m3); line != "DONE "+m3+" duplicate=false" {
		t.Fatalf("redelivered m3: %q, want it applied", line)
	}
	for _, m := range []string{m1, m2, m3} {
		if n := f.effects(m); n != 1 {
			t.Errorf("message %s applied %d times, want 1", m, n)
		}
	}
	if n := f.count(`SELECT count(*) FROM ` + f.db.Table("processed_event")); n != 3 {
		t.Errorf("dedup rows %d, want 3", n)
	}
	if err := c4.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	c4.WaitExit(t, 2*time.Minute)
}
