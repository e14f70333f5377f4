// Command demo runs onceflow's core path end to end and checks that the effect happened
// exactly once:
//
//	producers ──(business tx + outbox.WriteTx)──▶ PostgreSQL outbox
//	onceflow relay (child process, SIGKILLed and restarted) ──▶ Kafka
//	Kafka ──▶ Watermill router + inbox middleware ──▶ ledger (same tx as the dedup row)
//
// A "replayer" re-produces a share of the records to the topic, as a broker redelivery would,
// and the relay is killed mid-stream, so the consumer sees duplicates. At the end a table of
// invariants is printed; the exit status is non-zero if one fails.
//
// With nothing configured it starts a throwaway PostgreSQL and an in-process Kafka (kfake);
// with DATABASE_URL / KAFKA_BROKERS set it uses those servers (in a schema and topic of its
// own). `make demo-core` builds the onceflow binary and runs this.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	mrand "math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/examples/internal/platform"
	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
)

type options struct {
	binary     string
	events     int
	accounts   int
	producers  int
	duration   time.Duration
	replayRate float64
	kills      int
	timeout    time.Duration
}

func main() {
	var o options
	flag.StringVar(&o.binary, "onceflow", "bin/onceflow", "path to the onceflow binary (make demo-core builds it)")
	flag.IntVar(&o.events, "events", 6000, "deposit events to write")
	flag.IntVar(&o.accounts, "accounts", 50, "accounts (partition keys)")
	flag.IntVar(&o.producers, "producers", 4, "concurrent producer goroutines")
	flag.DurationVar(&o.duration, "duration", 12*time.Second, "how long the producers spread the writes over")
	flag.Float64Var(&o.replayRate, "replay", 0.10, "share of Kafka records re-produced as redeliveries")
	flag.IntVar(&o.kills, "relay-kills", 2, "times the relay is SIGKILLed and restarted mid-stream")
	flag.DurationVar(&o.timeout, "timeout", 50*time.Second, "give up if not every event is applied by then")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ok, err := run(ctx, o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
	if !ok {
		os.Exit(1)
	}
}

// deposit is the domain event: amount added to account, the account's seq-th deposit.
type deposit struct {
	Account string `json:"account"`
	Amount  int64  `json:"amount"`
	Seq     int64  `json:"seq"`
}

func run(ctx context.Context, o options) (bool, error) {
	start := time.Now()
	bin, err := filepath.Abs(o.binary)
	if err != nil {
		return false, err
	}
	if _, err := os.Stat(bin); err != nil {
		return false, fmt.Errorf("onceflow binary not found at %s: run `make demo-core` (it builds it) or pass -onceflow", bin)
	}

	// Infrastructure: embedded unless configured.
	suffix := randomHex(4)
	schema, topic := "demo_"+suffix, "demo.deposits."+suffix
	infra, err := platform.StartEmbedded(ctx) // through onceflowtest, removed at the end
	if err != nil {
		return false, err
	}
	defer infra.Stop()
	pgURL, brokers := infra.DatabaseURL, infra.Brokers
	if infra.StartedDB {
		fmt.Println("▸ PostgreSQL: throwaway cluster from the installed binaries (DATABASE_URL unset)")
	} else {
		fmt.Println("▸ PostgreSQL: DATABASE_URL")
	}
	if infra.StartedKafka {
		fmt.Printf("▸ Kafka: in-process kfake, %d partitions (KAFKA_BROKERS unset)\n", platform.Partitions)
	} else {
		fmt.Println("▸ Kafka: KAFKA_BROKERS")
	}

	pool, err := pgxpool.New(ctx, pgURL)
	if err != nil {
		return false, err
	}
	defer pool.Close()
	if _, err := migrations.Up(ctx, pool, migrations.Options{Schema: schema}); err != nil {
		return false, err
	}
	defer func() {
		// On a real server, leave nothing behind; an embedded cluster is removed anyway.
		cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := pool.Exec(cctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
			fmt.Fprintf(os.Stderr, "demo: drop schema %s: %v\n", schema, err)
		}
	}()
	t := func(name string) string { return pgx.Identifier{schema, name}.Sanitize() }
	if _, err := pool.Exec(ctx, `
		CREATE TABLE `+t("account")+` (id text PRIMARY KEY, seq bigint NOT NULL DEFAULT 0, deposited bigint NOT NULL DEFAULT 0);
		CREATE TABLE `+t("ledger")+` (account text PRIMARY KEY, balance bigint NOT NULL, events bigint NOT NULL,
			last_seq bigint NOT NULL, order_violations bigint NOT NULL DEFAULT 0)`); err != nil {
		return false, err
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+t("account")+` (id)
		SELECT 'acct-' || lpad(g::text, 3, '0') FROM generate_series(1, $1) g`, o.accounts); err != nil {
		return false, err
	}
	fmt.Printf("▸ schema %s migrated; topic %s\n", schema, topic)

	// Topics are provisioned before consumers subscribe, as in production: a consumer group
	// that subscribes to a topic that does not exist yet sits idle.
	if err := createTopic(ctx, brokers, topic, 4); err != nil {
		return false, err
	}

	// Consumer: Watermill router, watermill-kafka subscriber, inbox middleware.
	counters := &inbox.Counters{}
	consumer, err := startConsumer(ctx, pool, schema, brokers, topic, counters)
	if err != nil {
		return false, err
	}
	defer func() {
		if err := consumer.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "demo: close consumer:", err)
		}
	}()

	// Replayer: re-produces a share of what it reads, like a broker redelivering.
	rctx, stopReplay := context.WithCancel(ctx)
	replayer, err := startReplayer(rctx, brokers, topic, o.replayRate)
	if err != nil {
		stopReplay()
		return false, err
	}
	defer replayer.wait()
	defer stopReplay()

	// Relay: the onceflow binary as a child process.
	relay := &relayProc{bin: bin, args: []string{"relay",
		"--database-url", pgURL, "--schema", schema, "--kafka-brokers", strings.Join(brokers, ","),
		"--id", "demo-relay", "--log-level", "warn"}}
	if err := relay.start(); err != nil {
		return false, err
	}
	defer relay.stop()
	fmt.Printf("▸ onceflow relay started (pid %d)\n\n", relay.pid())

	// Producers write in business transactions; the relay is killed mid-stream.
	var written atomic.Int64
	prodErr := make(chan error, 1)
	go func() { prodErr <- produce(ctx, pool, schema, topic, o, &written) }()
	killAt := make([]int64, o.kills)
	for i := range killAt {
		killAt[i] = int64(o.events) * int64(i+1) / int64(o.kills+1)
	}

	deadline := time.Now().Add(o.timeout)
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	lastPrint := time.Time{}
	producing := true
	var applied int64
	for {
		select {
		case <-ctx.Done():
			return false, ctx.Err()
		case err := <-prodErr:
			if err != nil {
				return false, fmt.Errorf("producer: %w", err)
			}
			producing = false
		case <-tick.C:
		}
		if relay.exitedOnItsOwn() {
			return false, errors.New("the relay exited on its own; see its log lines above")
		}
		if len(killAt) > 0 && written.Load() >= killAt[0] {
			killAt = killAt[1:]
			pid := relay.pid()
			if err := relay.kill(); err != nil {
				return false, err
			}
			time.Sleep(300 * time.Millisecond) // let the stream move on without a relay
			if err := relay.start(); err != nil {
				return false, err
			}
			fmt.Printf("  ✗ relay pid %d SIGKILLed mid-stream; restarted as pid %d\n", pid, relay.pid())
		}
		if err := pool.QueryRow(ctx, `SELECT coalesce(sum(events), 0) FROM `+t("ledger")).Scan(&applied); err != nil {
			return false, err
		}
		s := counters.Snapshot()
		if time.Since(lastPrint) >= time.Second {
			lastPrint = time.Now()
			fmt.Printf("  %5.1fs  written %5d/%d   in kafka %5d (+%d replayed)   applied %5d   duplicates absorbed %4d   failed attempts %d\n",
				time.Since(start).Seconds(), written.Load(), o.events, replayer.seen.Load(), replayer.replayed.Load(), applied, s.Duplicates, s.Failures)
		}
		if !producing && applied >= int64(o.events) && replayer.caughtUp(counters) {
			break
		}
		if time.Now().After(deadline) {
			fmt.Printf("\n  timed out after %s waiting for every event to be applied\n", o.timeout)
			break
		}
	}
	stopReplay()
	replayer.wait()
	// Let in-flight redeliveries land so the duplicate count is final.
	time.Sleep(500 * time.Millisecond)
	return report(ctx, pool, schema, o, written.Load(), counters, replayer, relay, time.Since(start))
}

// produce writes o.events deposits in transactions of 1–3, spread over o.duration. Each
// transaction locks the account rows it touches (UPDATE ... RETURNING seq) before writing the
// events: that serialises writes per key, the precondition for per-key order.
func produce(ctx context.Context, pool *pgxpool.Pool, schema, topic string, o options, written *atomic.Int64) error {
	w, err := outbox.NewWriter(outbox.Config{Schema: schema})
	if err != nil {
		return err
	}
	var next atomic.Int64
	perTx := 2
	interval := o.duration / time.Duration(max(1, o.events/perTx))
	errs := make(chan error, o.producers)
	var wg sync.WaitGroup
	for p := range o.producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rnd := mrand.New(mrand.NewPCG(uint64(p)+1, uint64(time.Now().UnixNano())))
			tick := time.NewTicker(interval * time.Duration(o.producers))
			defer tick.Stop()
			for {
				k := int64(1 + rnd.IntN(3))
				end := next.Add(k)
				begin := end - k
				if begin >= int64(o.events) {
					return
				}
				end = min(end, int64(o.events))
				accounts := make([]string, end-begin)
				for i := range accounts {
					accounts[i] = fmt.Sprintf("acct-%03d", 1+rnd.IntN(o.accounts))
				}
				slices.Sort(accounts) // a fixed lock order: no deadlocks between producers
				if err := depositTx(ctx, pool, w, schema, topic, accounts, rnd); err != nil {
					errs <- err
					return
				}
				written.Add(end - begin)
				select {
				case <-ctx.Done():
					return
				case <-tick.C:
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

func depositTx(ctx context.Context, pool *pgxpool.Pool, w *outbox.Writer, schema, topic string, accounts []string, rnd *mrand.Rand) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		msgs := make([]*message.Message, len(accounts))
		for i, acct := range accounts {
			amount := int64(1 + rnd.IntN(100))
			var seq int64
			if err := tx.QueryRow(ctx, `UPDATE `+pgx.Identifier{schema, "account"}.Sanitize()+`
				SET seq = seq + 1, deposited = deposited + $2 WHERE id = $1 RETURNING seq`, acct, amount).Scan(&seq); err != nil {
				return err
			}
			payload, _ := json.Marshal(deposit{Account: acct, Amount: amount, Seq: seq})
			msgs[i] = outbox.SetPartitionKey(outbox.NewMessage(payload), acct)
		}
		return w.WriteTx(ctx, tx, topic, msgs...)
	})
}

// startConsumer runs a Watermill router whose only handler applies deposits to the ledger
// inside the inbox transaction.
func startConsumer(ctx context.Context, pool *pgxpool.Pool, schema string, brokers []string, topic string, counters *inbox.Counters) (*message.Router, error) {
	logger := watermill.NopLogger{}
	sub, err := inboxkafka.NewSubscriber(brokers, "demo-ledger", logger)
	if err != nil {
		return nil, err
	}
	ib, err := inbox.New(inbox.Config{Pool: pool, Schema: schema, Consumer: "demo-ledger", Metrics: counters,
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return nil, err
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return nil, err
	}
	retry := middleware.Retry{MaxRetries: 5, InitialInterval: 50 * time.Millisecond, ResetContextOnRetry: true, ShouldRetry: inbox.ShouldRetry}
	router.AddMiddleware(retry.Middleware, middleware.Recoverer, ib.Middleware)
	ledger := pgx.Identifier{schema, "ledger"}.Sanitize()
	router.AddConsumerHandler("ledger", topic, sub, func(msg *message.Message) error {
		var d deposit
		if err := json.Unmarshal(msg.Payload, &d); err != nil {
			return err
		}
		ctx := msg.Context()
		// The effect: add the amount, count the event, and check it is the account's next one.
		_, err := outbox.MustTx(ctx).Exec(ctx, `INSERT INTO `+ledger+` AS l (account, balance, events, last_seq, order_violations)
			VALUES ($1, $2::bigint, 1, $3::bigint, CASE WHEN $3::bigint = 1 THEN 0 ELSE 1 END)
			ON CONFLICT (account) DO UPDATE SET balance = l.balance + $2, events = l.events + 1, last_seq = $3,
				order_violations = l.order_violations + CASE WHEN $3 = l.last_seq + 1 THEN 0 ELSE 1 END`,
			d.Account, d.Amount, d.Seq)
		return err
	})
	go func() {
		if err := router.Run(ctx); err != nil {
			fmt.Fprintln(os.Stderr, "consumer router:", err)
		}
	}()
	select {
	case <-router.Running():
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return router, nil
}

func createTopic(ctx context.Context, brokers []string, topic string, partitions int32) error {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		return err
	}
	defer cl.Close()
	req := kmsg.NewPtrCreateTopicsRequest()
	t := kmsg.NewCreateTopicsRequestTopic()
	t.Topic, t.NumPartitions, t.ReplicationFactor = topic, partitions, -1
	req.Topics = append(req.Topics, t)
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return fmt.Errorf("create topic %s: %w", topic, err)
	}
	for _, rt := range resp.Topics {
		if err := kerr.ErrorForCode(rt.ErrorCode); err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
			return fmt.Errorf("create topic %s: %w", topic, err)
		}
	}
	return nil
}

// replayer reads the topic and re-produces a share of the records unchanged (same key, value
// and headers, so the same event id): what a consumer sees when the broker redelivers.
type replayer struct {
	seen, replayed atomic.Int64
	done           chan struct{}
}

func startReplayer(ctx context.Context, brokers []string, topic string, rate float64) (*replayer, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.AllowAutoTopicCreation())
	if err != nil {
		return nil, err
	}
	r := &replayer{done: make(chan struct{})}
	go func() {
		defer close(r.done)
		defer cl.Close()
		replayedIDs := map[string]bool{}
		for {
			fs := cl.PollFetches(ctx)
			if ctx.Err() != nil {
				return
			}
			fs.EachRecord(func(rec *kgo.Record) {
				id := headerValue(rec, "_watermill_message_uuid")
				if replayedIDs[id] {
					return // our own copy coming back
				}
				r.seen.Add(1)
				if mrand.Float64() >= rate {
					return
				}
				replayedIDs[id] = true
				dup := &kgo.Record{Topic: rec.Topic, Key: rec.Key, Value: rec.Value, Headers: rec.Headers}
				if err := cl.ProduceSync(ctx, dup).FirstErr(); err == nil {
					r.replayed.Add(1)
				}
			})
		}
	}()
	return r, nil
}

func (r *replayer) wait() { <-r.done }

// caughtUp reports whether the consumer has seen at least every replayed copy as a duplicate.
func (r *replayer) caughtUp(c *inbox.Counters) bool {
	return c.Snapshot().Duplicates >= r.replayed.Load()
}

func headerValue(rec *kgo.Record, key string) string {
	for _, h := range rec.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// relayProc is the `onceflow relay` child process.
type relayProc struct {
	bin      string
	args     []string
	mu       sync.Mutex
	cmd      *exec.Cmd
	exited   chan struct{}
	kills    int
	restarts int
}

func (r *relayProc) start() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	cmd := exec.Command(r.bin, r.args...)
	cmd.Stdout = io.Discard
	cmd.Stderr = prefixWriter{prefix: "  [relay] ", w: os.Stderr}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start onceflow relay: %w", err)
	}
	if r.cmd != nil {
		r.restarts++
	}
	r.cmd, r.exited = cmd, make(chan struct{})
	exited := r.exited
	go func() { cmd.Wait(); close(exited) }()
	return nil
}

func (r *relayProc) exitedOnItsOwn() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	select {
	case <-r.exited:
		return true
	default:
		return false
	}
}

func (r *relayProc) pid() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.cmd.Process.Pid
}

func (r *relayProc) kill() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		return err
	}
	<-r.exited
	r.kills++
	return nil
}

// stop ends the relay gracefully (SIGTERM), as an orchestrator would.
func (r *relayProc) stop() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-r.exited:
	case <-time.After(10 * time.Second):
		r.cmd.Process.Kill()
		<-r.exited
	}
}

type prefixWriter struct {
	prefix string
	w      io.Writer
}

func (p prefixWriter) Write(b []byte) (int, error) {
	for _, line := range strings.SplitAfter(string(b), "\n") {
		if line != "" {
			fmt.Fprint(p.w, p.prefix+line)
		}
	}
	return len(b), nil
}

func report(ctx context.Context, pool *pgxpool.Pool, schema string, o options, written int64, c *inbox.Counters, r *replayer, relay *relayProc, took time.Duration) (bool, error) {
	t := func(name string) string { return pgx.Identifier{schema, name}.Sanitize() }
	var applied, violations, dedupRows, outboxLeft, accountsWrong, accountsTotal int64
	var deposited, balance int64
	q := `SELECT
		(SELECT coalesce(sum(events), 0) FROM ` + t("ledger") + `),
		(SELECT coalesce(sum(order_violations), 0) FROM ` + t("ledger") + `),
		(SELECT count(*) FROM ` + t("processed_event") + ` WHERE consumer = 'demo-ledger'),
		(SELECT count(*) FROM ` + t("outbox") + `),
		(SELECT count(*) FROM ` + t("account") + ` a LEFT JOIN ` + t("ledger") + ` l ON l.account = a.id
			WHERE a.deposited <> coalesce(l.balance, 0) OR a.seq <> coalesce(l.events, 0)),
		(SELECT count(*) FROM ` + t("account") + `),
		(SELECT coalesce(sum(deposited), 0) FROM ` + t("account") + `),
		(SELECT coalesce(sum(balance), 0) FROM ` + t("ledger") + `)`
	if err := pool.QueryRow(ctx, q).Scan(&applied, &violations, &dedupRows, &outboxLeft, &accountsWrong, &accountsTotal, &deposited, &balance); err != nil {
		return false, err
	}
	s := c.Snapshot()
	type row struct {
		name, value string
		ok          bool
	}
	rows := []row{
		{"events written (committed with their business rows)", fmt.Sprint(written), written == int64(o.events)},
		{"events applied by the consumer", fmt.Sprint(applied), applied == written},
		{"events lost", fmt.Sprint(max(0, written-applied)), applied >= written},
		{"events applied twice", fmt.Sprint(max(0, applied-written)), applied <= written},
		{"dedup rows = events written", fmt.Sprint(dedupRows), dedupRows == written},
		{"duplicates delivered and absorbed", fmt.Sprintf("%d (%d replayed, %d re-published by a restarted relay)", s.Duplicates, r.replayed.Load(), max(0, r.seen.Load()-written)),
			s.Duplicates >= r.replayed.Load()+max(0, r.seen.Load()-written) && s.Duplicates > 0},
		{"account balances = ledger balances", fmt.Sprintf("%d/%d accounts, %d = %d", accountsTotal-accountsWrong, accountsTotal, deposited, balance), accountsWrong == 0 && deposited == balance},
		{"per-account order kept", fmt.Sprintf("%d out-of-order", violations), violations == 0},
		{"outbox drained", fmt.Sprintf("%d rows left", outboxLeft), outboxLeft == 0},
		{"relay SIGKILLed and restarted mid-stream", fmt.Sprintf("%d kills, %d restarts", relay.kills, relay.restarts), relay.kills == o.kills && relay.restarts == o.kills},
	}
	fmt.Printf("\nInvariants after %.1fs:\n\n", took.Seconds())
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  CHECK\tVALUE\tOK")
	allOK := true
	for _, r := range rows {
		mark := "✓"
		if !r.ok {
			mark, allOK = "✗ FAILED", false
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\n", r.name, r.value, mark)
	}
	tw.Flush()
	if allOK {
		fmt.Println("\nEvery event was applied exactly once, in order per account, despite the duplicates.")
	} else {
		fmt.Println("\nAt least one invariant failed.")
	}
	return allOK, nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(errors.New("crypto/rand failed"))
	}
	return hex.EncodeToString(b)
}
