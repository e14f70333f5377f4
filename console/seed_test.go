package console_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/onceflow/onceflow/console"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// seeded names what seed wrote.
type seeded struct {
	stuck, running, compensating, completed, compensated string
	evil                                                 string // a saga whose id and error are markup
	stuckEvent                                           string // the event id of the stuck saga's last command
	stuckReply                                           string // the event id of its action's reply
	parkedEvent, pendingEvent                            string
	scheduledEvent                                       string // due in 90 minutes, topic reminders
	parkedID                                             int64
	poisonID                                             int64
}

const evilText = `<script>alert("x")</script>&"'`

// seed writes sagas in every state, pending and parked outbox rows, a poison row, an
// idempotency record and a relay, the way the engines write them (the rows' columns, not the
// engines: the console reads tables).
func seed(t testing.TB, db *testdb.DB) seeded {
	t.Helper()
	ctx := context.Background()
	s := seeded{stuck: "order-stuck", running: "order-running", compensating: "order-comp", completed: "order-done",
		compensated: "order-undone", evil: "evil-" + evilText, stuckEvent: uuid.Must(uuid.NewV7()).String(), stuckReply: uuid.Must(uuid.NewV7()).String()}
	at := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	step := func(name, status string, sent ...saga.SentCommand) saga.StepHistory {
		started, finished := at, at.Add(time.Minute)
		h := saga.StepHistory{Name: name, Status: status, Attempts: len(sent), Sent: sent, StartedAt: &started}
		if status != "running" && status != "compensating" && status != "pending" {
			h.FinishedAt = &finished
		}
		return h
	}
	replied := func(h saga.StepHistory, r ...saga.ReceivedReply) saga.StepHistory { h.Replies = r; return h }
	cmd := func(topic string, phase outbox.SagaPhase, attempt int, id string) saga.SentCommand {
		if id == "" {
			id = uuid.Must(uuid.NewV7()).String()
		}
		return saga.SentCommand{Phase: phase, Attempt: attempt, Topic: topic, EventID: id, At: at.Add(time.Duration(attempt) * time.Second)}
	}
	for _, sg := range []struct {
		id, state, err string
		step           int
		steps          []saga.StepHistory
	}{
		{s.running, "running", "", 1, []saga.StepHistory{step("reserve", "done", cmd("reserve", outbox.SagaPhaseAction, 1, "")), step("charge", "running", cmd("charge", outbox.SagaPhaseAction, 1, ""))}},
		{s.compensating, "compensating", "step \"charge\": failed: card declined", 0, []saga.StepHistory{step("reserve", "compensating", cmd("release", outbox.SagaPhaseCompensation, 1, "")), step("charge", "failed")}},
		{s.stuck, "stuck", "compensation of step \"reserve\" failed after 3 attempts: stock service unavailable", 0,
			[]saga.StepHistory{replied(step("reserve", "compensating", cmd("reserve", outbox.SagaPhaseAction, 1, ""), cmd("release", outbox.SagaPhaseCompensation, 3, s.stuckEvent)),
				saga.ReceivedReply{Phase: outbox.SagaPhaseAction, Attempt: 1, Outcome: outbox.SagaOutcomeDone, EventID: s.stuckReply, At: at.Add(2 * time.Second)},
				saga.ReceivedReply{Phase: outbox.SagaPhaseCompensation, Attempt: 3, Outcome: outbox.SagaOutcomeRetry, Reason: "stock service unavailable", EventID: uuid.Must(uuid.NewV7()).String(), At: at.Add(4 * time.Second)}),
				step("charge", "failed")}},
		{s.completed, "completed", "", 1, []saga.StepHistory{step("reserve", "done"), step("charge", "done")}},
		{s.compensated, "compensated", "step \"charge\": failed: card declined", 0, []saga.StepHistory{step("reserve", "compensated"), step("charge", "failed")}},
		{s.evil, "stuck", evilText, 0, []saga.StepHistory{step(evilText, "compensating")}},
	} {
		steps, _ := json.Marshal(sg.steps)
		data, _ := json.Marshal(map[string]string{"order": sg.id, "note": evilText})
		finished := "NULL"
		if sg.state == "completed" || sg.state == "compensated" {
			finished = "now()"
		}
		if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("saga")+` (id, name, version, state, step, attempt, waiting, data, steps, error, created_at, updated_at, finished_at, trace)
			VALUES ($1, 'checkout', 1, $2, $3, 3, CASE WHEN $2 IN ('running', 'compensating') THEN 'reply' ELSE '' END, $4, $5, $6, $7, $7, `+finished+`,
			'{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}')`,
			sg.id, sg.state, sg.step, data, steps, sg.err, at); err != nil {
			t.Fatal(err)
		}
	}
	// The running saga's step timer, due in the future; the stuck one has none.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("saga_timer")+` (saga_id, kind, step, phase, attempt, action, due_at)
		VALUES ($1, 'step', 1, 'action', 1, 'timeout', now() + interval '10 minutes')`, s.running); err != nil {
		t.Fatal(err)
	}
	s.pendingEvent = uuid.Must(uuid.NewV7()).String()
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("outbox")+` (event_id, topic, partition_key, key_hash, payload, metadata, created_at, attempts, last_error)
		VALUES ($1, 'orders', 'o-1', 1, '{"n":1}', '{"k":"v"}', now() - interval '2 minutes', 2, 'broker down'),
		       ($2, 'orders', 'o-2', 2, '{"n":2}', '{}', now() - interval '1 minute', 0, NULL)`, s.pendingEvent, uuid.Must(uuid.NewV7()).String()); err != nil {
		t.Fatal(err)
	}
	s.parkedEvent = uuid.Must(uuid.NewV7()).String()
	s.parkedID = 9001
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("outbox_parked")+` (id, event_id, topic, partition_key, key_hash, payload, metadata, created_at, attempts, last_error, parked_by)
		VALUES ($1, $2, 'payments', 'p-1', 3, '{"amount":5}', '{}', now() - interval '3 hours', 10, 'MESSAGE_TOO_LARGE', 'relay-a')`, s.parkedID, s.parkedEvent); err != nil {
		t.Fatal(err)
	}
	s.scheduledEvent = uuid.Must(uuid.NewV7()).String()
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("outbox_scheduled")+` (event_id, topic, partition_key, key_hash, payload, metadata, due_at)
		VALUES ($1, 'reminders', 'o-1', 1, '{"remind":"o-1"}', '{"k":"v"}', now() + interval '90 minutes')`, s.scheduledEvent); err != nil {
		t.Fatal(err)
	}
	if err := db.Pool.QueryRow(ctx, `INSERT INTO `+db.Table("inbox_poison")+` (consumer, dedup_key, message_uuid, source, metadata, payload, attempts, error)
		VALUES ('projection', 'k-1', $1, 'orders/0@42', '{"saga_id":"x"}', $2, 5, $3) RETURNING id`,
		uuid.Must(uuid.NewV7()).String(), []byte(`{"bad":`+fmt.Sprintf("%q", evilText)+`}`), "handler: "+evilText).Scan(&s.poisonID); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("idempotency_record")+` (owner, idem_key, fingerprint, status, headers, body, expires_at)
		VALUES ('orders-api', 'key-1', '\x0102', 201, '{"Content-Type": ["application/json"]}', '{"order":"o-1"}', now() + interval '1 day')`); err != nil {
		t.Fatal(err)
	}
	// Barrier rows: the stuck saga's reserve action ran at the inventory participant; the
	// compensating saga's compensation came first at payments (a null compensation). Other
	// consumers' rows around them.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("processed_event")+` (consumer, dedup_key, result) VALUES
		('inventory', 'saga-barrier:"'||$1||'":"reserve":action', '{"reserved":2}'),
		('payments', 'saga-barrier:"'||$2||'":"charge":action', NULL),
		('payments', 'saga-barrier:"'||$2||'":"charge":compensation', NULL),
		('audit', 'event:1', NULL), ('zz-last', 'event:2', NULL)`, s.stuck, s.compensating); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("relay_member")+` (id, host, pid, expires_at) VALUES ('relay-a', 'host-a', 42, now() + interval '1 minute')`); err != nil {
		t.Fatal(err)
	}
	return s
}

// logBuffer is a concurrency-safe buffer for the action log.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}
func (l *logBuffer) String() string { l.mu.Lock(); defer l.mu.Unlock(); return l.b.String() }

// newServer serves a console over db, given the saga definitions defs; the log goes to the
// returned buffer.
func newServer(t testing.TB, db *testdb.DB, actions bool, defs ...saga.Known) (*httptest.Server, *logBuffer) {
	t.Helper()
	logs := &logBuffer{}
	h, err := console.New(console.Config{DB: db.Pool, Schema: db.Schema, Actions: actions, Prefix: "/ops", Sagas: defs,
		Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	// The user name comes from the service's own auth middleware.
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(w, r.WithContext(console.ContextWithUser(r.Context(), "alice")))
	}))
	t.Cleanup(srv.Close)
	return srv, logs
}

// browser is an HTTP client with a cookie jar that does not follow redirects.
type browser struct {
	t   testing.TB
	srv *httptest.Server
	c   *http.Client
}

func newBrowser(t testing.TB, srv *httptest.Server) *browser {
	jar, _ := cookiejar.New(nil)
	return &browser{t: t, srv: srv, c: &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}

type page struct {
	status int
	body   string
	header http.Header
}

func (b *browser) get(path string) page {
	b.t.Helper()
	resp, err := b.c.Get(b.srv.URL + path)
	if err != nil {
		b.t.Fatal(err)
	}
	return read(b.t, resp)
}

func (b *browser) post(path string, form url.Values, header ...string) page {
	b.t.Helper()
	req, _ := http.NewRequest(http.MethodPost, b.srv.URL+path, strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	// As a browser posting the console's own form; header pairs override it ("" removes).
	req.Header.Set("Origin", b.srv.URL)
	for i := 0; i+1 < len(header); i += 2 {
		if header[i+1] == "" {
			req.Header.Del(header[i])
			continue
		}
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := b.c.Do(req)
	if err != nil {
		b.t.Fatal(err)
	}
	return read(b.t, resp)
}

func read(t testing.TB, resp *http.Response) page {
	t.Helper()
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return page{status: resp.StatusCode, body: string(body), header: resp.Header}
}

var csrfField = regexp.MustCompile(`name="csrf" value="([0-9a-f]{64})"`)

// csrf is the token of the form on p.
func (p page) csrf(t testing.TB) string {
	t.Helper()
	m := csrfField.FindStringSubmatch(p.body)
	if m == nil {
		t.Fatalf("no CSRF field on the page:\n%s", p.body)
	}
	return m[1]
}

func (p page) expect(t testing.TB, what string, status int, contains ...string) page {
	t.Helper()
	if p.status != status {
		t.Fatalf("%s: status %d, want %d:\n%s", what, p.status, status, p.body)
	}
	for _, c := range contains {
		if !strings.Contains(p.body, c) {
			t.Errorf("%s: the page lacks %q:\n%s", what, c, p.body)
		}
	}
	return p
}
