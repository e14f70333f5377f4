package browsertest

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/onceflow/onceflow/console"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

// seeded names what seed wrote.
type seeded struct {
	stuck, running, compensating, completed, compensated string
	evil                                                 string // a saga whose id and error are markup
	stuckEvent                                           string // the event id of the stuck saga's last command
	parkedEvent                                          string
	poisonID                                             int64
}

const evilText = `<script>alert("x")</script>&"'`

// at is when the seeded sagas started: an hour ago, to the second.
func seedTime() time.Time { return time.Now().Add(-time.Hour).UTC().Truncate(time.Second) }

// step is a step of a saga's history as the orchestrator records it.
func step(at time.Time, name, status string, sent ...saga.SentCommand) saga.StepHistory {
	started, finished := at, at.Add(time.Minute)
	h := saga.StepHistory{Name: name, Status: status, Attempts: len(sent), Sent: sent, StartedAt: &started}
	switch status {
	case "running", "compensating":
	case "pending":
		h.StartedAt = nil
	default:
		h.FinishedAt = &finished
	}
	return h
}

// command is a command the orchestrator sent for a step, with a fresh event id unless id is set.
func command(at time.Time, topic string, phase outbox.SagaPhase, attempt int, id string) saga.SentCommand {
	if id == "" {
		id = uuid.Must(uuid.NewV7()).String()
	}
	return saga.SentCommand{Phase: phase, Attempt: attempt, Topic: topic, EventID: id, At: at.Add(time.Duration(attempt) * time.Second)}
}

// sagaRow is a checkout saga's row as the orchestrator writes it (the table's columns: the
// console reads what the engines wrote, so the tests write the same).
type sagaRow struct {
	id, state, err string
	step           int
	steps          []saga.StepHistory
	createdAt      time.Time
}

func insertSaga(t testing.TB, db *testdb.DB, r sagaRow) {
	t.Helper()
	steps, _ := json.Marshal(r.steps)
	data, _ := json.Marshal(map[string]string{"order": r.id, "note": evilText})
	finished := "NULL"
	if r.state == "completed" || r.state == "compensated" {
		finished = "now()"
	}
	if _, err := db.Pool.Exec(context.Background(), `INSERT INTO `+db.Table("saga")+` (id, name, version, state, step, attempt, waiting, data, steps, error, created_at, updated_at, finished_at, trace)
		VALUES ($1, 'checkout', 1, $2, $3, 3, CASE WHEN $2 IN ('running', 'compensating') THEN 'reply' ELSE '' END, $4, $5, $6, $7, $7, `+finished+`,
		'{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}')`,
		r.id, r.state, r.step, data, steps, r.err, r.createdAt); err != nil {
		t.Fatal(err)
	}
}

// seed writes sagas in every state (one whose id and error are markup), pending and parked
// outbox rows, a poison row, an idempotency record, barrier rows and a relay, the way the
// engines write them. It is the console package's test seed, which the screenshots in
// docs/console show.
func seed(t testing.TB, db *testdb.DB) seeded {
	t.Helper()
	ctx := context.Background()
	s := seeded{stuck: "order-stuck", running: "order-running", compensating: "order-comp", completed: "order-done",
		compensated: "order-undone", evil: "evil-" + evilText, stuckEvent: uuid.Must(uuid.NewV7()).String()}
	at := seedTime()
	replied := func(h saga.StepHistory, r ...saga.ReceivedReply) saga.StepHistory { h.Replies = r; return h }
	cmd := func(topic string, phase outbox.SagaPhase, attempt int, id string) saga.SentCommand {
		return command(at, topic, phase, attempt, id)
	}
	for _, r := range []sagaRow{
		{s.running, "running", "", 1, []saga.StepHistory{step(at, "reserve", "done", cmd("reserve", outbox.SagaPhaseAction, 1, "")), step(at, "charge", "running", cmd("charge", outbox.SagaPhaseAction, 1, ""))}, at},
		{s.compensating, "compensating", "step \"charge\": failed: card declined", 0, []saga.StepHistory{step(at, "reserve", "compensating", cmd("release", outbox.SagaPhaseCompensation, 1, "")), step(at, "charge", "failed")}, at},
		{s.stuck, "stuck", "compensation of step \"reserve\" failed after 3 attempts: stock service unavailable", 0,
			[]saga.StepHistory{replied(step(at, "reserve", "compensating", cmd("reserve", outbox.SagaPhaseAction, 1, ""), cmd("release", outbox.SagaPhaseCompensation, 3, s.stuckEvent)),
				saga.ReceivedReply{Phase: outbox.SagaPhaseAction, Attempt: 1, Outcome: outbox.SagaOutcomeDone, EventID: uuid.Must(uuid.NewV7()).String(), At: at.Add(2 * time.Second)},
				saga.ReceivedReply{Phase: outbox.SagaPhaseCompensation, Attempt: 3, Outcome: outbox.SagaOutcomeRetry, Reason: "stock service unavailable", EventID: uuid.Must(uuid.NewV7()).String(), At: at.Add(4 * time.Second)}),
				step(at, "charge", "failed")}, at},
		{s.completed, "completed", "", 1, []saga.StepHistory{step(at, "reserve", "done"), step(at, "charge", "done")}, at},
		{s.compensated, "compensated", "step \"charge\": failed: card declined", 0, []saga.StepHistory{step(at, "reserve", "compensated"), step(at, "charge", "failed")}, at},
		{s.evil, "stuck", evilText, 0, []saga.StepHistory{step(at, evilText, "compensating")}, at},
	} {
		insertSaga(t, db, r)
	}
	// The running saga's step timer, due in the future; the stuck one has none.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("saga_timer")+` (saga_id, kind, step, phase, attempt, action, due_at)
		VALUES ($1, 'step', 1, 'action', 1, 'timeout', now() + interval '10 minutes')`, s.running); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("outbox")+` (event_id, topic, partition_key, key_hash, payload, metadata, created_at, attempts, last_error)
		VALUES ($1, 'orders', 'o-1', 1, '{"n":1}', '{"k":"v"}', now() - interval '2 minutes', 2, 'broker down'),
		       ($2, 'orders', 'o-2', 2, '{"n":2}', '{}', now() - interval '1 minute', 0, NULL)`, uuid.Must(uuid.NewV7()).String(), uuid.Must(uuid.NewV7()).String()); err != nil {
		t.Fatal(err)
	}
	s.parkedEvent = uuid.Must(uuid.NewV7()).String()
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("outbox_parked")+` (id, event_id, topic, partition_key, key_hash, payload, metadata, created_at, attempts, last_error, parked_by)
		VALUES (9001, $1, 'payments', 'p-1', 3, '{"amount":5}', '{}', now() - interval '3 hours', 10, 'MESSAGE_TOO_LARGE', 'relay-a')`, s.parkedEvent); err != nil {
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
	// compensating saga's compensation came first at payments (a null compensation).
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

// An operator's credential, as `onceflow ui` takes it from ONCEFLOW_UI_USER and
// ONCEFLOW_UI_PASSWORD: the audit trail and the action log name its user.
const operator, operatorPassword = "alice", "s3cret-for-alice"

// newServer serves the console over db, with actions on, mounted under /ops/ as a service
// mounts it, behind the operator's credential (console.RequireCredentials, as `onceflow ui`
// does); the action log goes to the returned buffer.
func newServer(t testing.TB, db *testdb.DB) (*httptest.Server, *syncBuffer) {
	t.Helper()
	logs := &syncBuffer{}
	h, err := console.New(console.Config{DB: db.Pool, Schema: db.Schema, Actions: true, Prefix: "/ops",
		Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	guarded, err := console.RequireCredentials(h, console.Credentials{User: operator, Password: operatorPassword})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/ops/", guarded)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv, logs
}

// operatorRequests are the saga ids with an operator request (kind 'operator') of action
// filed, in id order.
func operatorRequests(t testing.TB, db *testdb.DB, action string) []string {
	t.Helper()
	var ids []string
	rows, err := db.Pool.Query(context.Background(), `SELECT saga_id FROM `+db.Table("saga_timer")+` WHERE kind = 'operator' AND action = $1 ORDER BY saga_id`, action)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return ids
}
