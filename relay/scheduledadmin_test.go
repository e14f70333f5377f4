package relay_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// scheduleAt writes one message of topic, due at, through the outbox writer (as a service
// does), and returns its event id.
func scheduleAt(t *testing.T, db *testdb.DB, w *outbox.Writer, topic, key string, at time.Time) string {
	t.Helper()
	ctx := context.Background()
	msg := outbox.SetPartitionKey(outbox.NewMessage([]byte(`{"n":1}`)), key)
	msg.Metadata.Set("trace", "t-"+topic)
	outbox.DeliverAt(msg, at)
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return w.WriteTx(ctx, tx, topic, msg) }); err != nil {
		t.Fatal(err)
	}
	return msg.UUID
}

// The scheduled view: a summary bounded by the due index (count, next due, overdue beyond
// ScheduledOverdueAfter, topics of the next rows), pages in due order chained by their
// cursors, a topic filter, and Find telling that an event is scheduled and when it is due.
func TestAdminScheduled(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	admin, err := relay.NewAdmin(db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	s, err := admin.ScheduledSummary(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if s.Rows != 0 || !s.Exact || !s.NextDue.IsZero() || s.Overdue != 0 || s.Lag() != 0 || s.CheckedAt.IsZero() {
		t.Fatalf("nothing scheduled: %+v", s)
	}
	p, err := admin.Scheduled(ctx, db.Pool, relay.ScheduledFilter{})
	if err != nil || len(p.Messages) != 0 || p.Next != "" {
		t.Fatalf("nothing scheduled: page %+v, %v", p, err)
	}

	// No relay runs: overdue rows stay where they are.
	now := time.Now()
	late := scheduleAt(t, db, w, "reminders", "o-1", now.Add(-time.Hour))       // overdue
	late2 := scheduleAt(t, db, w, "reminders", "o-2", now.Add(-time.Minute))    // overdue
	justDue := scheduleAt(t, db, w, "invoices", "o-3", now.Add(-2*time.Second)) // due, within the grace
	var later []string                                                          // due in 1..5 h
	for i := range 5 {
		topic := "reminders"
		if i%2 == 1 {
			topic = "invoices"
		}
		later = append(later, scheduleAt(t, db, w, topic, "o-4", now.Add(time.Duration(i+1)*time.Hour)))
	}
	want := append([]string{late, late2, justDue}, later...)

	if s, err = admin.ScheduledSummary(ctx, db.Pool); err != nil {
		t.Fatal(err)
	}
	if s.Rows != 8 || !s.Exact || s.Overdue != 2 || s.OverdueCapped || s.NextEventID != late || s.NextTopic != "reminders" ||
		s.Lag() < 59*time.Minute || s.Lag() > 61*time.Minute {
		t.Errorf("summary: %+v (lag %s)", s, s.Lag())
	}
	topics, err := admin.ScheduledPerTopic(ctx, db.Pool, relay.ScheduledSample)
	if err != nil {
		t.Fatal(err)
	}
	if len(topics) != 2 || topics[0].Topic != "reminders" || topics[0].Rows != 5 || !topics[0].NextDue.Equal(s.NextDue) ||
		topics[1].Topic != "invoices" || topics[1].Rows != 3 {
		t.Errorf("per topic: %+v", topics)
	}
	if topics, err = admin.ScheduledPerTopic(ctx, db.Pool, 2); err != nil || len(topics) != 1 || topics[0].Rows != 2 {
		t.Errorf("per topic among the next 2: %+v, %v", topics, err)
	}
	if all, err := admin.ScheduledPerTopic(ctx, db.Pool, 0); err != nil || len(all) != 2 || all[0].Rows != 5 || all[1].Rows != 3 {
		t.Errorf("exact per topic: %+v, %v", all, err)
	}

	// Pages of 3 in due order, chained by Next until it is "".
	var got []string
	f := relay.ScheduledFilter{Limit: 3}
	for pages := 0; ; pages++ {
		p, err := admin.Scheduled(ctx, db.Pool, f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range p.Messages {
			got = append(got, m.EventID)
		}
		if p.Next == "" {
			break
		}
		if pages > 5 {
			t.Fatal("the pages do not end")
		}
		f.After = p.Next
	}
	if !slices.Equal(got, want) {
		t.Errorf("pages in due order: %v\nwant %v", got, want)
	}
	p, err = admin.Scheduled(ctx, db.Pool, relay.ScheduledFilter{Topic: "invoices"})
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Messages) != 3 || p.Messages[0].EventID != justDue || p.Next != "" || p.Searched != 0 {
		t.Errorf("topic invoices: %+v", p)
	}
	m := p.Messages[0]
	if m.Topic != "invoices" || m.Key != "o-3" || m.Size != 7 || m.Metadata["trace"] != "t-invoices" || m.Seq == 0 ||
		m.DueAt.Sub(now).Abs() > time.Second+2*time.Second || m.CreatedAt.IsZero() {
		t.Errorf("scheduled message: %+v", m)
	}

	// Bad input says what to pass and reads nothing.
	if _, err := admin.Scheduled(ctx, db.Pool, relay.ScheduledFilter{After: "nope"}); !errors.Is(err, relay.ErrBadScheduledCursor) {
		t.Errorf("bad cursor: %v", err)
	}
	if _, err := admin.Scheduled(ctx, db.Pool, relay.ScheduledFilter{Limit: relay.MaxListLimit + 1}); err == nil {
		t.Error("a page over MaxListLimit was not refused")
	}

	// Find says scheduled, and when it is due; after a cancel, gone.
	found, err := admin.Find(ctx, db.Pool, later[0])
	if err != nil {
		t.Fatal(err)
	}
	if found.Where() != "scheduled" || len(found.Scheduled) != 1 || len(found.Pending) != 0 ||
		found.Scheduled[0].DueAt.Sub(now.Add(time.Hour)).Abs() > time.Second || found.Scheduled[0].Topic != "reminders" {
		t.Errorf("find a scheduled event: %+v", found)
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		ok, err := w.CancelTx(ctx, tx, later[0])
		if err == nil && !ok {
			err = errors.New("not cancelled")
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if found, err = admin.Find(ctx, db.Pool, later[0]); err != nil || found.Where() != "gone" {
		t.Errorf("find a cancelled event: %+v, %v", found, err)
	}
}

// Bounded at any number of rows: counts stop at ExactBacklogRows (then an estimate), and a
// topic filter walks at most MaxScheduledScan rows per page, ending the page early with a
// cursor that goes on.
func TestAdminScheduledBounded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	admin, err := relay.NewAdmin(db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	// MaxScheduledScan rows due tomorrow (ExactBacklogRows+1 of them overdue by a day), then one
	// row of a rare topic due after them.
	n := relay.MaxScheduledScan
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("outbox_scheduled")+` (event_id, topic, key_hash, payload, due_at)
		SELECT gen_random_uuid(), 'bulk', g, 'x', CASE WHEN g <= $2 THEN now() - interval '1 day' ELSE now() + interval '1 day' END + g * interval '1 ms'
		FROM generate_series(1, $1) g`, n, relay.ExactBacklogRows+1); err != nil {
		t.Fatal(err)
	}
	rare := uuid.NewString()
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("outbox_scheduled")+` (event_id, topic, key_hash, payload, due_at)
		VALUES ($1, 'rare', 1, 'x', now() + interval '2 days')`, rare); err != nil {
		t.Fatal(err)
	}
	s, err := admin.ScheduledSummary(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if s.Exact || s.Rows <= relay.ExactBacklogRows || s.Overdue != relay.ExactBacklogRows || !s.OverdueCapped || s.Lag() < 23*time.Hour {
		t.Errorf("summary of %d rows: %+v", n+1, s)
	}
	if topics, err := admin.ScheduledPerTopic(ctx, db.Pool, relay.ScheduledSample); err != nil || len(topics) != 1 ||
		topics[0].Topic != "bulk" || topics[0].Rows != relay.ScheduledSample {
		t.Errorf("per topic among the next %d: %+v, %v", relay.ScheduledSample, topics, err)
	}
	p, err := admin.Scheduled(ctx, db.Pool, relay.ScheduledFilter{Topic: "rare"})
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Messages) != 0 || p.Searched != relay.MaxScheduledScan || p.Next == "" {
		t.Fatalf("first page of a rare topic: %d messages, searched %d, next %q", len(p.Messages), p.Searched, p.Next)
	}
	if p, err = admin.Scheduled(ctx, db.Pool, relay.ScheduledFilter{Topic: "rare", After: p.Next}); err != nil {
		t.Fatal(err)
	}
	if len(p.Messages) != 1 || p.Messages[0].EventID != rare || p.Next != "" || p.Searched != 0 {
		t.Fatalf("second page of a rare topic: %+v", p)
	}
}

// scheduledMetrics records the relay's ScheduledRows reports.
type scheduledMetrics struct {
	relay.NopMetrics
	mu            sync.Mutex
	rows, overdue int64
	reports       int
}

func (m *scheduledMetrics) ScheduledRows(rows, overdue int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.rows, m.overdue = rows, overdue
	m.reports++
}

func (m *scheduledMetrics) get() (rows, overdue int64, reports int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.rows, m.overdue, m.reports
}

// ackAll acknowledges every message.
type ackAll struct{}

func (ackAll) Publish(context.Context, []*relay.Message, []error) {}
func (ackAll) Close() error                                       { return nil }

// A relay reports the scheduled rows and the overdue ones with Pending. An overdue row is
// one it cannot move: a cancel that has not committed holds it (the relay skips locked
// rows), so the metric shows it overdue until the cancel rolls back and the row is moved.
func TestRelayReportsScheduledRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	held := scheduleAt(t, db, w, "reminders", "k", time.Now().Add(-time.Minute))
	scheduleAt(t, db, w, "reminders", "k", time.Now().Add(24*time.Hour))
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if ok, err := w.CancelTx(ctx, tx, held); err != nil || !ok {
		t.Fatalf("cancel: %v, %v", ok, err)
	}

	m := &scheduledMetrics{}
	r, err := relay.New(relay.Config{Pool: db.Pool, Sink: ackAll{}, Schema: db.Schema, Metrics: m, StatsInterval: 50 * time.Millisecond,
		Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	stop := startRelay(t, r)
	defer stop()
	eventually(t, 10*time.Second, "a report of 2 scheduled rows, 1 overdue", func() bool {
		rows, overdue, _ := m.get()
		return rows == 2 && overdue == 1
	})
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "a report of 1 scheduled row, none overdue", func() bool {
		rows, overdue, _ := m.get()
		return rows == 1 && overdue == 0
	})
}
