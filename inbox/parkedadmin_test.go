package inbox_test

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/audit"
	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
)

// park inserts a parked row and returns its id: lane "" has none; due nil waits behind its
// lane's head, else due in *due (negative: overdue); parked ago before now.
func (f *adminFixture) park(consumer, topic, lane string, due *time.Duration, ago time.Duration) int64 {
	f.t.Helper()
	var laneArg *string
	if lane != "" {
		laneArg = &lane
	}
	var dueSecs *float64
	if due != nil {
		s := due.Seconds()
		dueSecs = &s
	}
	var id int64
	if err := f.db.Pool.QueryRow(context.Background(), `INSERT INTO `+f.db.Table("inbox_parked")+`
		(consumer, topic, lane, dedup_key, message_uuid, source, payload, attempts, error, due_at, parked_at)
		VALUES ($1, $2, $3, 'key-' || gen_random_uuid(), gen_random_uuid()::text, $2 || '/0@7', 'x',
			CASE WHEN $4::float8 IS NULL THEN 0 ELSE 2 END, CASE WHEN $4::float8 IS NULL THEN '' ELSE 'provider down' END,
			now() + make_interval(secs => $4), now() - make_interval(secs => $5))
		RETURNING id`, consumer, topic, laneArg, dueSecs, ago.Seconds()).Scan(&id); err != nil {
		f.t.Fatal(err)
	}
	return id
}

func in(d time.Duration) *time.Duration { return &d }

func parkedIDs(rows []inbox.ParkedRow) []int64 {
	out := make([]int64, len(rows))
	for i, r := range rows {
		out[i] = r.ID
	}
	return out
}

// listAll pages through f's listing with pages of limit and returns every row.
func (f *adminFixture) listAll(pf inbox.ParkedFilter, limit int) []inbox.ParkedRow {
	f.t.Helper()
	pf.Limit = limit
	var all []inbox.ParkedRow
	for range 100 {
		p, err := f.admin.Parked(context.Background(), f.db.Pool, pf)
		if err != nil {
			f.t.Fatal(err)
		}
		all = append(all, p.Rows...)
		if p.Next == "" {
			return all
		}
		pf.After = p.Next
	}
	f.t.Fatal("the listing does not end")
	return nil
}

// Parked lists each lane's head and then the rows behind it, lane by lane, then the rows
// parked without a key; pages of any size add up to the whole listing; filters select a
// consumer, a topic, a key; id order lists them as parked; a head is told from a row behind.
func TestAdminParked(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newAdminFixture(t)
	if p, err := f.admin.Parked(ctx, f.db.Pool, inbox.ParkedFilter{}); err != nil || len(p.Rows) != 0 || p.Next != "" {
		t.Fatalf("Parked on an empty table = %+v, %v", p, err)
	}
	// In the order they were parked, across lanes.
	a1 := f.park("billing", "orders", "A", in(10*time.Minute), time.Hour)
	b1 := f.park("billing", "orders", "B", in(-time.Minute), 50*time.Minute)
	a2 := f.park("billing", "orders", "A", nil, 40*time.Minute)
	alone := f.park("billing", "orders", "", in(5*time.Minute), 30*time.Minute)
	x1 := f.park("audit", "orders", "A", in(time.Minute), 20*time.Minute)
	a3 := f.park("billing", "orders", "A", nil, 10*time.Minute)
	r1 := f.park("billing", "refunds", "A", in(time.Minute), time.Minute)

	laneOrder := []int64{x1, a1, a2, a3, b1, r1, alone}
	for _, limit := range []int{1, 2, 3, 100} {
		if got := parkedIDs(f.listAll(inbox.ParkedFilter{}, limit)); !slices.Equal(got, laneOrder) {
			t.Errorf("lane order in pages of %d: %v, want %v", limit, got, laneOrder)
		}
	}
	p, err := f.admin.Parked(ctx, f.db.Pool, inbox.ParkedFilter{})
	if err != nil {
		t.Fatal(err)
	}
	head := map[int64]bool{}
	for _, r := range p.Rows {
		head[r.ID] = r.Head
		if r.Head != (r.DueAt != nil) {
			t.Errorf("row %d: head %v, due %v", r.ID, r.Head, r.DueAt)
		}
	}
	if !head[a1] || head[a2] || head[a3] || !head[b1] || !head[alone] || !head[x1] || !head[r1] {
		t.Errorf("heads: %v", head)
	}
	r := p.Rows[1]
	if r.ID != a1 || r.Consumer != "billing" || r.Topic != "orders" || r.Lane != "A" || r.Attempts != 2 || r.Error != "provider down" ||
		r.Source != "orders/0@7" || !strings.HasPrefix(r.DedupKey, "key-") || r.MessageUUID == "" ||
		r.DueAt.Sub(p.CheckedAt) < 9*time.Minute || p.CheckedAt.Sub(r.ParkedAt) < 59*time.Minute {
		t.Errorf("row a1: %+v (checked at %s)", r, p.CheckedAt)
	}
	if p.Rows[6].Lane != "" || p.Rows[2].DueAt != nil || p.Rows[2].Error != "" {
		t.Errorf("alone %+v, behind %+v", p.Rows[6], p.Rows[2])
	}

	for _, tc := range []struct {
		f    inbox.ParkedFilter
		want []int64
	}{
		{inbox.ParkedFilter{Consumer: "billing"}, []int64{a1, a2, a3, b1, r1, alone}},
		{inbox.ParkedFilter{Consumer: "billing", Topic: "orders"}, []int64{a1, a2, a3, b1, alone}},
		{inbox.ParkedFilter{Consumer: "billing", Topic: "orders", Lane: "A"}, []int64{a1, a2, a3}},
		{inbox.ParkedFilter{Consumer: "nobody"}, nil},
		{inbox.ParkedFilter{Order: inbox.ParkedByID}, []int64{a1, b1, a2, alone, x1, a3, r1}},
		{inbox.ParkedFilter{Consumer: "billing", Topic: "refunds"}, []int64{r1}},
		{inbox.ParkedFilter{Order: inbox.ParkedByID, Consumer: "billing"}, []int64{a1, b1, a2, alone, a3, r1}},
		{inbox.ParkedFilter{Order: inbox.ParkedByID, Consumer: "billing", Topic: "orders", Lane: "A"}, []int64{a1, a2, a3}},
	} {
		for _, limit := range []int{1, 2, 100} {
			if got := parkedIDs(f.listAll(tc.f, limit)); !slices.Equal(got, tc.want) && (len(got) > 0 || len(tc.want) > 0) {
				t.Errorf("%+v in pages of %d: %v, want %v", tc.f, limit, got, tc.want)
			}
		}
	}

	// Bad input says what to do and reads nothing.
	first, err := f.admin.Parked(ctx, f.db.Pool, inbox.ParkedFilter{Limit: 1})
	if err != nil || first.Next == "" {
		t.Fatalf("a first page of 1: %+v, %v", first, err)
	}
	for _, tc := range []struct {
		f    inbox.ParkedFilter
		want string
	}{
		{inbox.ParkedFilter{Topic: "orders"}, "give the Consumer too"},
		{inbox.ParkedFilter{Lane: "A"}, "give the Consumer too"},
		{inbox.ParkedFilter{Consumer: "billing", Lane: "A"}, "give the Topic too"},
		{inbox.ParkedFilter{Order: "due"}, `use "lane" (the default) or "id"`},
		{inbox.ParkedFilter{Limit: inbox.MaxListLimit + 1}, "Limit is 1001"},
		{inbox.ParkedFilter{Limit: -1}, "Limit is -1"},
		{inbox.ParkedFilter{After: "nonsense!"}, "not a cursor"},
		{inbox.ParkedFilter{After: first.Next, Order: inbox.ParkedByID}, "not a cursor"},
	} {
		_, err := f.admin.Parked(ctx, f.db.Pool, tc.f)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Parked(%+v) = %v, want %q", tc.f, err, tc.want)
		}
	}
	if _, err := f.admin.Parked(ctx, f.db.Pool, inbox.ParkedFilter{After: "nonsense!"}); !errors.Is(err, inbox.ErrBadParkedCursor) {
		t.Errorf("a bad cursor: %v", err)
	}
}

// In id order with a filter, a page reads at most MaxParkedScan rows: a consumer with one row
// behind many of another's gets an empty page that says where to go on, and the next finds it.
func TestAdminParkedByIDScanBound(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newAdminFixture(t)
	if _, err := f.db.Pool.Exec(ctx, `INSERT INTO `+f.db.Table("inbox_parked")+` (consumer, topic, lane, dedup_key, message_uuid, payload, due_at)
		SELECT 'busy', 'orders', NULL, 'k-' || g, 'm-' || g, 'x', now() FROM generate_series(1, $1) g`, inbox.MaxParkedScan+10); err != nil {
		t.Fatal(err)
	}
	late := f.park("quiet", "orders", "", in(time.Minute), 0)
	pf := inbox.ParkedFilter{Order: inbox.ParkedByID, Consumer: "quiet"}
	p, err := f.admin.Parked(ctx, f.db.Pool, pf)
	if err != nil || len(p.Rows) != 0 || p.Searched != inbox.MaxParkedScan || p.Next == "" {
		t.Fatalf("first page: %d rows, searched %d, next %q, %v", len(p.Rows), p.Searched, p.Next, err)
	}
	pf.After = p.Next
	if p, err = f.admin.Parked(ctx, f.db.Pool, pf); err != nil || !slices.Equal(parkedIDs(p.Rows), []int64{late}) || p.Next != "" || p.Searched != 0 {
		t.Errorf("second page: %v, searched %d, next %q, %v", parkedIDs(p.Rows), p.Searched, p.Next, err)
	}
}

// ParkedSummary: per consumer, the rows, the keys (a row without a key is one), the oldest
// row and its key, the next due; its lag while a head is overdue.
func TestAdminParkedSummary(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newAdminFixture(t)
	if s, err := f.admin.ParkedSummary(ctx, f.db.Pool); err != nil || len(s) != 0 {
		t.Fatalf("ParkedSummary on an empty table = %+v, %v", s, err)
	}
	f.park("billing", "orders", "A", in(10*time.Minute), 30*time.Minute)
	f.park("billing", "orders", "A", nil, 20*time.Minute)
	oldest := f.park("billing", "refunds", "A", in(2*time.Minute), 2*time.Hour)
	f.park("billing", "orders", "", in(5*time.Minute), time.Minute)
	f.park("billing", "orders", "", in(6*time.Minute), time.Minute)
	f.park("audit", "orders", "Z", in(-3*time.Minute), 10*time.Minute)
	s, err := f.admin.ParkedSummary(ctx, f.db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if len(s) != 2 || s[0].Consumer != "audit" || s[1].Consumer != "billing" {
		t.Fatalf("ParkedSummary = %+v", s)
	}
	b := s[1]
	if b.Rows != 5 || b.Keys != 4 || !b.RowsExact || !b.KeysExact || b.OldestID != oldest || b.OldestTopic != "refunds" || b.OldestLane != "A" ||
		b.OldestAge() < 119*time.Minute || b.OldestAge() > 121*time.Minute || b.Lag() != 0 ||
		b.NextDue.Sub(b.CheckedAt) < 119*time.Second || b.NextDue.Sub(b.CheckedAt) > 121*time.Second {
		t.Errorf("billing: %+v (oldest %s)", b, b.OldestAge())
	}
	if a := s[0]; a.Rows != 1 || a.Keys != 1 || a.OldestLane != "Z" || a.Lag() < 179*time.Second || a.Lag() > 181*time.Second {
		t.Errorf("audit: %+v (lag %s)", a, a.Lag())
	}
}

// ReleaseTx makes heads due now, by id or every head of a consumer, and records it; a row
// behind its head, a missing row or another consumer's is refused with nothing changed; a
// head due already is left as it is.
func TestAdminReleaseTx(t *testing.T) {
	t.Parallel()
	ctx := audit.WithActor(context.Background(), "ops:alice")
	f := newAdminFixture(t)
	a1 := f.park("billing", "orders", "A", in(time.Hour), time.Hour)
	a2 := f.park("billing", "orders", "A", nil, time.Minute)
	b1 := f.park("billing", "orders", "B", in(time.Hour), time.Hour)
	c1 := f.park("billing", "orders", "C", in(-time.Minute), time.Hour)
	alone := f.park("billing", "orders", "", in(time.Hour), time.Hour)
	x1 := f.park("audit", "orders", "A", in(time.Hour), time.Hour)
	release := func(rf inbox.ReleaseFilter) ([]int64, error) {
		var ids []int64
		err := pgx.BeginFunc(ctx, f.db.Pool, func(tx pgx.Tx) error {
			var err error
			ids, err = f.admin.ReleaseTx(ctx, tx, rf)
			return err
		})
		return ids, err
	}
	due := func() []int64 {
		p, err := f.admin.Parked(ctx, f.db.Pool, inbox.ParkedFilter{Order: inbox.ParkedByID})
		if err != nil {
			t.Fatal(err)
		}
		var out []int64
		for _, r := range p.Rows {
			if r.DueAt != nil && !r.DueAt.After(p.CheckedAt) {
				out = append(out, r.ID)
			}
		}
		return out
	}

	for _, tc := range []struct {
		rf   inbox.ReleaseFilter
		is   error
		want string
	}{
		{inbox.ReleaseFilter{}, inbox.ErrEmptyReleaseFilter, "name the rows"},
		{inbox.ReleaseFilter{IDs: []int64{a1, a2}}, inbox.ErrReleaseRefused, `waits behind row ` + itoa(a1) + `, the head of key "A"`},
		{inbox.ReleaseFilter{IDs: []int64{a1, 999999}}, inbox.ErrNoParkedRow, "with id 999999"},
		{inbox.ReleaseFilter{IDs: []int64{a1, x1}, Consumer: "billing"}, inbox.ErrNoParkedRow, `of consumer "billing" with id ` + itoa(x1)},
		{inbox.ReleaseFilter{Consumer: "billing", Limit: inbox.MaxReleaseLimit + 1}, nil, "limit 10001"},
	} {
		_, err := release(tc.rf)
		if err == nil || (tc.is != nil && !errors.Is(err, tc.is)) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ReleaseTx(%+v) = %v, want %q", tc.rf, err, tc.want)
		}
	}
	if got := due(); !slices.Equal(got, []int64{c1}) {
		t.Fatalf("refused releases changed the due rows: %v", got)
	}

	if ids, err := release(inbox.ReleaseFilter{IDs: []int64{a1, c1}, Consumer: "billing"}); err != nil || !slices.Equal(ids, []int64{a1}) {
		t.Errorf("release a1 and (due already) c1 = %v, %v", ids, err)
	}
	if got := due(); !slices.Equal(got, []int64{a1, c1}) {
		t.Errorf("due after releasing a1: %v", got)
	}
	if ids, err := release(inbox.ReleaseFilter{Consumer: "billing"}); err != nil || !slices.Equal(ids, []int64{b1, alone}) {
		t.Errorf("release billing's heads = %v, %v", ids, err)
	}
	if got := due(); !slices.Equal(got, []int64{a1, b1, c1, alone}) {
		t.Errorf("due after releasing billing: %v (x1 is audit's, a2 waits behind a1)", got)
	}
	if ids, err := release(inbox.ReleaseFilter{Consumer: "billing"}); err != nil || len(ids) != 0 {
		t.Errorf("a second release = %v, %v", ids, err)
	}

	es, err := audit.List(ctx, f.db.Pool, f.db.Schema, audit.Filter{Actions: []string{audit.InboxRelease}})
	if err != nil {
		t.Fatal(err)
	}
	if len(es) != 2 || es[0].Actor != "ops:alice" || !slices.Equal(es[0].Targets, []string{itoa(b1), itoa(alone)}) || es[0].Filter != "consumer=billing" ||
		es[0].Outcome != "retry-lane heads made due now: 2" || !slices.Equal(es[1].Targets, []string{itoa(a1)}) || es[1].Filter != "" {
		t.Errorf("audit: %+v", es)
	}
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// The cost of the retry lane's reads at 100,000 parked rows (an outage of a provider that
// lasted long): over 1,000 keys, and without keys (each row a head). The summary and pages
// deep in the listing are index ranges; the times are logged (-v), and a page at the end of
// the listing is checked to be the end.
func TestParkedReadCost(t *testing.T) {
	t.Parallel()
	for _, shape := range []struct {
		name, lane, due string
	}{
		{"100k rows over 1k keys", `'key-' || l`, `CASE WHEN n = 1 THEN now() + l * interval '1 second' END`},
		{"100k rows without a key", `NULL`, `now() + (l * 100 + n) * interval '10 ms'`},
	} {
		t.Run(shape.name, func(t *testing.T) {
			t.Parallel()
			parkedReadCost(t, shape.lane, shape.due)
		})
	}
}

func parkedReadCost(t *testing.T, lane, due string) {
	ctx := context.Background()
	f := newAdminFixture(t)
	const lanes, perLane = 1000, 100
	if _, err := f.db.Pool.Exec(ctx, `INSERT INTO `+f.db.Table("inbox_parked")+`
		(consumer, topic, lane, dedup_key, message_uuid, source, payload, attempts, error, due_at, parked_at)
		SELECT CASE WHEN l % 10 = 0 THEN 'audit' ELSE 'billing' END, 'orders', `+lane+`, 'k-' || l || '-' || n, gen_random_uuid()::text,
			'orders/' || (l % 12) || '@' || n, convert_to(repeat('x', 200), 'UTF8'), CASE WHEN n = 1 THEN 3 ELSE 0 END,
			CASE WHEN n = 1 THEN 'provider down: 503 Service Unavailable' ELSE '' END,
			`+due+`, now() - interval '2 hours' + n * interval '1 minute'
		FROM generate_series(1, $1) l, generate_series(1, $2) n ORDER BY l, n`, lanes, perLane); err != nil {
		t.Fatal(err)
	}
	// Statistics, as autovacuum gathers them after such a burst of inserts; the visibility
	// map is left unset (no VACUUM): index-only reads still visit the table.
	if _, err := f.db.Pool.Exec(ctx, `ANALYZE `+f.db.Table("inbox_parked")); err != nil {
		t.Fatal(err)
	}
	timeIt := func(what string, fn func() error) {
		var best time.Duration
		for i := range 5 {
			start := time.Now()
			if err := fn(); err != nil {
				t.Fatal(err)
			}
			if d := time.Since(start); i == 0 || d < best {
				best = d
			}
		}
		t.Logf("%s: best of 5 %s", what, best)
	}
	var s []inbox.ConsumerParked
	timeIt("ParkedSummary", func() (err error) { s, err = f.admin.ParkedSummary(ctx, f.db.Pool); return err })
	wantKeys, exact := int64(900), true
	if lane == "NULL" {
		wantKeys, exact = inbox.ParkedCountCap+1, false
	}
	if len(s) != 2 || s[1].Rows != inbox.ParkedCountCap+1 || s[1].RowsExact || s[1].Keys != wantKeys || s[1].KeysExact != exact ||
		s[1].OldestAge() < 118*time.Minute {
		t.Errorf("summary: %+v", s)
	}
	timeIt("Parked, the first page of 100", func() error {
		_, err := f.admin.Parked(ctx, f.db.Pool, inbox.ParkedFilter{})
		return err
	})
	if lane != "NULL" {
		timeIt("Parked, a page of 100 of consumer billing's last key", func() error {
			_, err := f.admin.Parked(ctx, f.db.Pool, inbox.ParkedFilter{Consumer: "billing", Topic: "orders", Lane: "key-999"})
			return err
		})
	}
	timeIt("Parked by id, consumer audit, the first page of 100", func() error {
		_, err := f.admin.Parked(ctx, f.db.Pool, inbox.ParkedFilter{Consumer: "audit", Order: inbox.ParkedByID})
		return err
	})
	// The last page of consumer audit's 10,000 rows (in lane order, then the rows without a
	// key) costs what its first page does.
	pf := inbox.ParkedFilter{Consumer: "audit", Limit: inbox.MaxListLimit}
	timeIt("Parked, the first page of 1000 of consumer audit's 10k rows", func() error {
		_, err := f.admin.Parked(ctx, f.db.Pool, pf)
		return err
	})
	for range 9 {
		p, err := f.admin.Parked(ctx, f.db.Pool, pf)
		if err != nil || p.Next == "" {
			t.Fatalf("a page of audit's rows: next %q, %v", p.Next, err)
		}
		pf.After = p.Next
	}
	var last inbox.ParkedPage
	timeIt("Parked, the last page of 1000 of consumer audit's 10k rows", func() (err error) {
		last, err = f.admin.Parked(ctx, f.db.Pool, pf)
		return err
	})
	if len(last.Rows) != inbox.MaxListLimit || last.Next != "" {
		t.Errorf("the last page: %d rows, next %q", len(last.Rows), last.Next)
	}
	// Once vacuum has set the visibility map, the counts read the indexes alone.
	if _, err := f.db.Pool.Exec(ctx, `VACUUM `+f.db.Table("inbox_parked")); err != nil {
		t.Fatal(err)
	}
	timeIt("ParkedSummary after VACUUM", func() (err error) { _, err = f.admin.ParkedSummary(ctx, f.db.Pool); return err })
}

// An operator's release ("retry now") of a head parked for an hour: a running router applies it
// within its lane interval, then the message of its key parked behind it, each once; a row
// behind is refused; the release is in the audit trail; the lane is empty afterwards.
func TestReleaseAppliesTheHead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, func(c *inbox.Config) { c.LaneInterval = 50 * time.Millisecond })
	admin, err := inbox.NewAdmin(f.db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	logger := watermill.NopLogger{}
	k := kafkatest.Fake(t, 1)
	topic := kafkatest.Topic("orders")
	sub, err := kafka.NewSubscriber(inboxkafka.SubscriberConfig(k.Brokers(), kafkatest.Topic("billing")), logger)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: k.Brokers(), Marshaler: kafka.DefaultMarshaler{}}, logger)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(f.ib.Poison, middleware.Recoverer, f.ib.Middleware)
	router.AddPlugin(f.ib.RouterPlugin)
	var tries atomic.Int32
	router.AddConsumerHandler("billing", topic, sub, func(msg *message.Message) error {
		if string(msg.Payload) == "A1" && tries.Add(1) == 1 {
			return inbox.RetryAfter(errors.New("provider down"), time.Hour)
		}
		return f.applyEffect(msg, string(msg.Payload))
	})
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- router.Run(runCtx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	<-router.Running()
	for _, m := range []*message.Message{keyed("A", "A1"), keyed("A", "A2"), keyed("B", "B1")} {
		if err := pub.Publish(topic, m); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "B1 applied, A1 and A2 parked", func() bool {
		return f.count(`SELECT count(*) FROM `+f.db.Table("effect")+` WHERE note = 'B1'`) == 1 && f.count(`SELECT count(*) FROM `+f.db.Table("inbox_parked")) == 2
	})
	p, err := admin.Parked(ctx, f.db.Pool, inbox.ParkedFilter{Consumer: "billing"})
	if err != nil || len(p.Rows) != 2 {
		t.Fatalf("Parked = %+v, %v", p, err)
	}
	head, behind := p.Rows[0], p.Rows[1]
	if !head.Head || head.Lane != "A" || head.Topic != topic || head.Attempts != 1 || !strings.Contains(head.Error, "provider down") ||
		head.Handler != "billing" || head.DueAt == nil || head.DueAt.Sub(p.CheckedAt) < 59*time.Minute || behind.Head || behind.DueAt != nil {
		t.Fatalf("the lane: head %+v, behind %+v", head, behind)
	}
	s, err := admin.ParkedSummary(ctx, f.db.Pool)
	if err != nil || len(s) != 1 || s[0].Rows != 2 || s[0].Keys != 1 || s[0].OldestID != head.ID || s[0].OldestLane != "A" {
		t.Fatalf("ParkedSummary = %+v, %v", s, err)
	}
	release := func(ids ...int64) ([]int64, error) {
		var out []int64
		err := pgx.BeginFunc(ctx, f.db.Pool, func(tx pgx.Tx) error {
			var err error
			out, err = admin.ReleaseTx(audit.WithActor(ctx, "test:ops"), tx, inbox.ReleaseFilter{IDs: ids})
			return err
		})
		return out, err
	}
	if _, err := release(behind.ID); !errors.Is(err, inbox.ErrReleaseRefused) {
		t.Fatalf("releasing the row behind: %v", err)
	}
	if got, err := release(head.ID); err != nil || !slices.Equal(got, []int64{head.ID}) {
		t.Fatalf("releasing the head = %v, %v", got, err)
	}
	waitFor(t, "A1 and A2 applied", func() bool { return f.count(`SELECT count(*) FROM `+f.db.Table("effect")+` WHERE note LIKE 'A%'`) == 2 })
	if got := f.effectOrder(); strings.Join(got, ",") != "B1,A1,A2" {
		t.Errorf("applied %v, want B1, A1, A2", got)
	}
	waitFor(t, "the lane empty", func() bool { return f.count(`SELECT count(*) FROM `+f.db.Table("inbox_parked")) == 0 })
	if s, err := admin.ParkedSummary(ctx, f.db.Pool); err != nil || len(s) != 0 {
		t.Errorf("ParkedSummary after = %+v, %v", s, err)
	}
	es, err := audit.List(ctx, f.db.Pool, f.db.Schema, audit.Filter{Target: itoa(head.ID), Actions: []string{audit.InboxRelease}})
	if err != nil || len(es) != 1 || es[0].Actor != "test:ops" {
		t.Errorf("audit: %+v, %v", es, err)
	}
}
