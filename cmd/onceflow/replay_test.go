package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/console"
	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/outbox"
)

// Issue 25's "done when": a consumer with a bug poisons 50 of 1,000 messages — a router
// consumer (ib.Poison, Retry, Recoverer, ib.Middleware) and a batched one (BatchConsumer with
// BatchNoPublish) — while a third group of the topic (audit) applies all 1,000. After the fix
// is deployed (the handler switched to a fixed one), `onceflow inbox poison replay --consumer`
// replays the router's 50 and the console's button the batched consumer's 50: each is applied
// exactly once, the audit group applies nothing twice, and a second replay is refused.
func TestReplayPoisonedMessagesExactlyOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	env := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema, "USER": "alice"}
	brokers := kafkatest.Brokers(t, 4)
	topic := kafkatest.Topic("orders")
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE `+db.Table("effect")+` (id bigserial PRIMARY KEY, consumer text NOT NULL, msg_uuid text NOT NULL)`); err != nil {
		t.Fatal(err)
	}

	// 1,000 messages with the relay's record layout; every 20th hits the bug.
	const total, buggy = 1000, 50
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.DefaultProduceTopic(topic), kgo.AllowAutoTopicCreation())
	if err != nil {
		t.Fatal(err)
	}
	var recs []*kgo.Record
	for i := range total {
		payload := fmt.Sprintf("order-%d", i)
		if i%(total/buggy) == 0 {
			payload = "bug-" + payload
		}
		recs = append(recs, &kgo.Record{Key: fmt.Appendf(nil, "k%d", i%16), Value: []byte(payload),
			Headers: []kgo.RecordHeader{{Key: kafka.UUIDHeaderKey, Value: []byte(outbox.NewUUID())}}})
	}
	if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	cl.Close()

	var fixed atomic.Bool // the fix deployed
	handler := func(consumer string, bug bool) func(*message.Message) error {
		return func(msg *message.Message) error {
			if bug && !fixed.Load() && strings.HasPrefix(string(msg.Payload), "bug-") {
				return errors.New("bug: division by zero")
			}
			_, err := outbox.MustTx(msg.Context()).Exec(msg.Context(), `INSERT INTO `+db.Table("effect")+` (consumer, msg_uuid) VALUES ($1, $2)`, consumer, msg.UUID)
			return err
		}
	}
	newInbox := func(consumer string) *inbox.Inbox {
		ib, err := inbox.New(inbox.Config{Pool: db.Pool, Schema: db.Schema, Consumer: consumer, Logger: quiet, ReplayInterval: 50 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		return ib
	}
	runCtx, cancel := context.WithCancel(ctx)
	var stops []chan error
	t.Cleanup(func() {
		cancel()
		for _, done := range stops {
			if err := <-done; err != nil {
				t.Errorf("consumer: %v", err)
			}
		}
	})
	startBatch := func(group string, p inbox.BatchProcessor) {
		c, err := inboxkafka.NewBatchConsumer(inboxkafka.BatchConfig{Brokers: brokers, Group: group, Topics: []string{topic}, Processor: p,
			Workers: 2, MaxAttempts: 2, Backoff: time.Millisecond, MaxBackoff: 10 * time.Millisecond, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		stops = append(stops, done)
		go func() { done <- c.Run(runCtx) }()
	}
	startBatch("audit", newInbox("audit").BatchNoPublish(handler("audit", false)))
	startBatch("billing-batch", newInbox("billing-batch").BatchNoPublish(handler("billing-batch", true)))

	routerInbox := newInbox("billing-router")
	wlog := watermill.NopLogger{}
	sub, err := inboxkafka.NewSubscriber(brokers, "billing-router", wlog)
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, wlog)
	if err != nil {
		t.Fatal(err)
	}
	retry := middleware.Retry{MaxRetries: 1, InitialInterval: time.Millisecond, ResetContextOnRetry: true, ShouldRetry: inbox.ShouldRetry}
	router.AddMiddleware(routerInbox.Poison, retry.Middleware, middleware.Recoverer, routerInbox.Middleware)
	router.AddPlugin(routerInbox.RouterPlugin)
	router.AddConsumerHandler("billing", topic, sub, handler("billing-router", true))
	routerDone := make(chan error, 1)
	stops = append(stops, routerDone)
	go func() { routerDone <- router.Run(runCtx) }()

	count := func(sql string, args ...any) int {
		t.Helper()
		var n int
		if err := db.Pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		return n
	}
	effects := func(consumer string) (n, distinct int) {
		t.Helper()
		if err := db.Pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT msg_uuid) FROM `+db.Table("effect")+` WHERE consumer = $1`, consumer).
			Scan(&n, &distinct); err != nil {
			t.Fatal(err)
		}
		return n, distinct
	}
	poison := func(consumer, state string) int {
		return count(`SELECT count(*) FROM `+db.Table("inbox_poison")+` WHERE consumer = $1 AND state = $2`, consumer, state)
	}
	waitUntil(t, 2*time.Minute, "950 effects and 50 poison rows per buggy consumer, 1,000 audit effects", func() bool {
		a, _ := effects("audit")
		b, _ := effects("billing-batch")
		r, _ := effects("billing-router")
		return a == total && b == total-buggy && r == total-buggy &&
			poison("billing-batch", inbox.StatePoison) == buggy && poison("billing-router", inbox.StatePoison) == buggy
	})

	fixed.Store(true)
	// The router consumer's 50, from the command line: a dry run first, then the request.
	r := runCmd(ctx, env, "inbox", "poison", "replay", "--consumer", "billing-router", "--dry-run").expect(t, "replay --dry-run", 0)
	if !strings.Contains(r.stdout, "50 poison rows would be replayed (dry run: nothing changed); ids: ") || poison("billing-router", inbox.StatePoison) != buggy {
		t.Fatalf("dry run:\n%s", r.stdout)
	}
	r = runCmd(ctx, env, "inbox", "poison", "replay", "--consumer", "billing-router").expect(t, "replay --consumer", 0)
	if !strings.Contains(r.stdout, "50 poison rows requested for replay") {
		t.Fatalf("replay:\n%s", r.stdout)
	}
	// The batched consumer's 50, from the console: the dry-run count first, then the button.
	var actions testutil.SyncBuffer
	srv, b := consoleClient(t, db, &actions)
	conf := b.get(t, srv.URL+"/inbox/replay?consumer=billing-batch")
	if !strings.Contains(conf, "Dry run: <b>50</b> match") {
		t.Fatalf("the console's confirmation does not show the dry-run count:\n%s", conf)
	}
	if code, body := b.post(t, srv.URL+"/inbox/replay", url.Values{"csrf": {csrfOf(t, conf)}, "consumer": {"billing-batch"}}); code != http.StatusOK ||
		!strings.Contains(body, "50 replays requested") {
		t.Fatalf("console replay: %d\n%s", code, body)
	}

	waitUntil(t, time.Minute, "every replay applied", func() bool {
		return poison("billing-router", inbox.StateReplayed) == buggy && poison("billing-batch", inbox.StateReplayed) == buggy
	})
	for _, consumer := range []string{"billing-router", "billing-batch", "audit"} {
		if n, distinct := effects(consumer); n != total || distinct != total {
			t.Errorf("consumer %s: %d effects of %d messages, want each of the %d once", consumer, n, distinct, total)
		}
	}
	if n := count(`SELECT count(*) FROM ` + db.Table("inbox_poison") + ` WHERE replay_requested_by = 'cli:alice'`); n != buggy {
		t.Errorf("%d rows requested by cli:alice, want %d", n, buggy)
	}
	if n := count(`SELECT count(*) FROM ` + db.Table("inbox_poison") + ` WHERE replay_requested_by LIKE 'console:%'`); n != buggy {
		t.Errorf("%d rows requested from the console, want %d", n, buggy)
	}

	// A second replay is refused, by filter, by id and from the console, and changes nothing.
	r = runCmd(ctx, env, "inbox", "poison", "replay", "--consumer", "billing-router").expect(t, "second replay", 1)
	if !strings.Contains(r.stderr, "no poison row matches") {
		t.Errorf("second replay by consumer:\n%s", r.stderr)
	}
	var oneID string
	if err := db.Pool.QueryRow(ctx, `SELECT min(id)::text FROM `+db.Table("inbox_poison")+` WHERE consumer = 'billing-router'`).Scan(&oneID); err != nil {
		t.Fatal(err)
	}
	r = runCmd(ctx, env, "inbox", "poison", "replay", "--id", oneID).expect(t, "second replay by id", 1)
	if !strings.Contains(r.stderr, "replayed already") {
		t.Errorf("second replay by id:\n%s", r.stderr)
	}
	if code, body := b.post(t, srv.URL+"/inbox/replay", url.Values{"csrf": {csrfOf(t, conf)}, "consumer": {"billing-batch"}}); code != http.StatusBadRequest ||
		!strings.Contains(body, "no poison row matches") {
		t.Errorf("second console replay: %d\n%s", code, body)
	}
	if code, body := b.post(t, srv.URL+"/inbox/"+oneID+"/replay", url.Values{"csrf": {csrfOf(t, conf)}}); code != http.StatusBadRequest ||
		!strings.Contains(body, "replayed already") {
		t.Errorf("second console replay of one row: %d\n%s", code, body)
	}
	for _, consumer := range []string{"billing-router", "billing-batch", "audit"} {
		if n, _ := effects(consumer); n != total {
			t.Errorf("consumer %s: %d effects after the refused replays, want %d", consumer, n, total)
		}
	}
	// The action log says who did what.
	if log := actions.String(); !strings.Contains(log, `msg="console: action" user=operator-1 action="inbox poison replay"`) ||
		!strings.Contains(log, "consumer=billing-batch") || !strings.Contains(log, "requested=50") {
		t.Errorf("console action log:\n%s", log)
	}
}

// waitUntil polls cond until it holds or d passes.
func waitUntil(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// consoleClient serves the console with actions on, and a client that keeps its cookies.
func consoleClient(t *testing.T, db *testdb.DB, log io.Writer) (*httptest.Server, *webClient) {
	t.Helper()
	c, err := console.New(console.Config{DB: db.Pool, Schema: db.Schema, Actions: true, Logger: slog.New(slog.NewTextHandler(log, nil))})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c.ServeHTTP(w, r.WithContext(console.ContextWithUser(r.Context(), "operator-1")))
	}))
	t.Cleanup(srv.Close)
	jar, _ := cookiejar.New(nil)
	return srv, &webClient{c: &http.Client{Jar: jar}}
}

type webClient struct{ c *http.Client }

func (b *webClient) get(t *testing.T, u string) string {
	t.Helper()
	resp, err := b.c.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d\n%s", u, resp.StatusCode, body)
	}
	return string(body)
}

// post submits a form, as a browser on the console's page does (with its Origin), and
// follows the redirect; it returns the final status and page.
func (b *webClient) post(t *testing.T, u string, form url.Values) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, u, strings.NewReader(form.Encode()))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", "http://"+req.URL.Host)
	resp, err := b.c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

func csrfOf(t *testing.T, page string) string {
	t.Helper()
	m := regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`).FindStringSubmatch(page)
	if m == nil {
		t.Fatalf("no CSRF token in the page:\n%s", page)
	}
	return m[1]
}
