package inbox_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/testdb"
)

// adminFixture is a migrated schema with an inbox.Admin over it.
type adminFixture struct {
	t     *testing.T
	db    *testdb.DB
	admin *inbox.Admin
}

func newAdminFixture(t *testing.T) *adminFixture {
	t.Helper()
	db := testdb.New(t)
	a, err := inbox.NewAdmin(db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	return &adminFixture{t: t, db: db, admin: a}
}

// poison inserts a poison row and returns its id.
func (f *adminFixture) poison(consumer, errText, state string, payload []byte) int64 {
	f.t.Helper()
	var id int64
	if err := f.db.Pool.QueryRow(context.Background(), `INSERT INTO `+f.db.Table("inbox_poison")+`
		(consumer, dedup_key, message_uuid, source, metadata, payload, attempts, error, state, replay_requested_at, history)
		VALUES ($1, 'key-' || gen_random_uuid(), gen_random_uuid()::text, 'orders/0@7', '{"k": "v"}', coalesce($2, ''::bytea), 5, $3, $4,
			CASE WHEN $4 = 'replay_requested' THEN now() - interval '1 minute' END,
			'[{"at": "2026-12-01T00:00:00Z", "event": "requested", "by": "test"}]')
		RETURNING id`, consumer, payload, errText, state).Scan(&id); err != nil {
		f.t.Fatal(err)
	}
	return id
}

func ids(rows []inbox.PoisonRow) []int64 {
	out := make([]int64, len(rows))
	for i, r := range rows {
		out[i] = r.ID
	}
	return out
}

// Poison lists newest first, pages with Before until the oldest row, filters by consumer,
// and reads payloads only when asked; PoisonByID reads one row in full, and a missing id is
// ErrNoPoisonRow.
func TestAdminPoison(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newAdminFixture(t)
	if rows, err := f.admin.Poison(ctx, f.db.Pool, inbox.PoisonFilter{}); err != nil || len(rows) != 0 {
		t.Fatalf("Poison on an empty table = %v, %v", rows, err)
	}
	var billing, all []int64
	for i := range 7 {
		consumer := "billing"
		if i%3 == 2 {
			consumer = "audit"
		}
		id := f.poison(consumer, "boom", inbox.StatePoison, []byte(`{"n":1}`))
		all = append(all, id)
		if consumer == "billing" {
			billing = append(billing, id)
		}
	}
	slices.Reverse(all)
	slices.Reverse(billing)

	// Every page of three, newest first, until an empty page.
	walk := func(consumer string) []int64 {
		t.Helper()
		var got []int64
		fl := inbox.PoisonFilter{Consumer: consumer, Limit: 3}
		for range 10 {
			page, err := f.admin.Poison(ctx, f.db.Pool, fl)
			if err != nil {
				t.Fatal(err)
			}
			if len(page) == 0 {
				return got
			}
			got = append(got, ids(page)...)
			fl.Before = page[len(page)-1].ID
		}
		t.Fatalf("the pages of %q do not end", consumer)
		return nil
	}
	if got := walk(""); !slices.Equal(got, all) {
		t.Errorf("pages of every consumer = %v, want %v", got, all)
	}
	if got := walk("billing"); !slices.Equal(got, billing) {
		t.Errorf("pages of billing = %v, want %v", got, billing)
	}
	if got := walk("nobody"); len(got) != 0 {
		t.Errorf("pages of an unknown consumer = %v", got)
	}

	rows, err := f.admin.Poison(ctx, f.db.Pool, inbox.PoisonFilter{Consumer: "audit"})
	if err != nil || len(rows) != 2 {
		t.Fatalf("Poison(audit) = %d rows, %v", len(rows), err)
	}
	r := rows[0]
	if r.Payload != nil || r.Consumer != "audit" || r.DedupKey == nil || r.Attempts != 5 || r.Error != "boom" || r.State != inbox.StatePoison ||
		r.Metadata["k"] != "v" || r.Source != "orders/0@7" || r.MessageUUID == "" || r.FailedAt.IsZero() || len(r.History) != 1 || r.Refusal != nil {
		t.Errorf("a row without payload: %+v", r)
	}
	rows, err = f.admin.Poison(ctx, f.db.Pool, inbox.PoisonFilter{Consumer: "audit", WithPayload: true, Limit: 1})
	if err != nil || len(rows) != 1 || string(rows[0].Payload) != `{"n":1}` || rows[0].ID != r.ID {
		t.Errorf("Poison with payload, limit 1 = %+v, %v", rows, err)
	}

	one, err := f.admin.PoisonByID(ctx, f.db.Pool, billing[0])
	if err != nil || one.ID != billing[0] || string(one.Payload) != `{"n":1}` || one.History[0]["by"] != "test" {
		t.Errorf("PoisonByID = %+v, %v", one, err)
	}
	_, err = f.admin.PoisonByID(ctx, f.db.Pool, 999_999)
	if !errors.Is(err, inbox.ErrNoPoisonRow) || !strings.Contains(err.Error(), "999999") {
		t.Errorf("PoisonByID of a missing row: %v, want ErrNoPoisonRow naming the id", err)
	}
	if _, err := f.admin.PoisonByID(ctx, f.db.Pool, 0); err == nil || errors.Is(err, inbox.ErrNoPoisonRow) {
		t.Errorf("PoisonByID(0): %v, want a bad-input error", err)
	}
}

// Bad input gets an error that says what to pass, before any SQL; an unmigrated schema says
// to migrate.
func TestAdminBadInput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, s := range []string{"Bad-Schema", "1x", `x"; DROP TABLE y; --`} {
		if _, err := inbox.NewAdmin(s); err == nil || !strings.Contains(err.Error(), "invalid schema name") {
			t.Errorf("NewAdmin(%q): %v", s, err)
		}
	}
	if a, err := inbox.NewAdmin(""); err != nil || a == nil {
		t.Errorf("NewAdmin(\"\"): %v", err)
	}
	f := newAdminFixture(t)
	for _, c := range []struct {
		name string
		fl   inbox.PoisonFilter
		want string
	}{
		{"negative limit", inbox.PoisonFilter{Limit: -1}, "Limit is -1"},
		{"limit over the max", inbox.PoisonFilter{Limit: inbox.MaxListLimit + 1}, "1..1000"},
		{"negative before", inbox.PoisonFilter{Before: -5}, "Before is -5"},
	} {
		if _, err := f.admin.Poison(ctx, f.db.Pool, c.fl); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
	if _, _, err := f.admin.CountPoison(ctx, f.db.Pool, "billing", "", 0); err == nil || !strings.Contains(err.Error(), "max is 0") {
		t.Errorf("CountPoison with max 0: %v", err)
	}
	if _, err := f.admin.Expired(ctx, f.db.Pool, 0, 10, false); err == nil || !strings.Contains(err.Error(), "window is 0s") {
		t.Errorf("Expired with window 0: %v", err)
	}
	if _, err := f.admin.Expired(ctx, f.db.Pool, time.Hour, -1, false); err == nil || !strings.Contains(err.Error(), "max is -1") {
		t.Errorf("Expired with max -1: %v", err)
	}
	if _, _, err := f.admin.Processed(ctx, f.db.Pool, "", "k"); err == nil || !strings.Contains(err.Error(), "give the consumer") {
		t.Errorf("Processed without a consumer: %v", err)
	}

	bare, err := inbox.NewAdmin("not_migrated_" + strings.TrimPrefix(f.db.Schema, "t_"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bare.Poison(ctx, f.db.Pool, inbox.PoisonFilter{}); err == nil || !strings.Contains(err.Error(), "onceflow migrate up --schema not_migrated_") {
		t.Errorf("Poison of an unmigrated schema: %v", err)
	}
}

// CountPoison counts what DeletePoisonTx by the same filter deletes — the consumer's rows whose
// error contains the text, case-insensitively, oldest first, up to the cap — and returns the
// first ids; without a consumer it counts every consumer's rows.
func TestAdminCountPoisonIsWhatDeleteTakes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newAdminFixture(t)
	var timeouts []int64
	for i := range 30 {
		switch i % 3 {
		case 0:
			timeouts = append(timeouts, f.poison("billing", "read: TIMEOUT after 5s", inbox.StatePoison, nil))
		case 1:
			f.poison("billing", "constraint failed", inbox.StatePoison, nil)
		case 2:
			f.poison("audit", "timeout", inbox.StatePoison, nil)
		}
	}
	n, first, err := f.admin.CountPoison(ctx, f.db.Pool, "", "", 1000)
	if err != nil || n != 30 || len(first) != inbox.CountPoisonIDs {
		t.Errorf("CountPoison of every row = %d, %d ids, %v", n, len(first), err)
	}
	n, first, err = f.admin.CountPoison(ctx, f.db.Pool, "billing", "timeout", 1000)
	if err != nil || n != 10 || !slices.Equal(first, timeouts) {
		t.Errorf("CountPoison(billing, timeout) = %d, %v, %v; want 10, %v", n, first, err, timeouts)
	}
	if n, first, err := f.admin.CountPoison(ctx, f.db.Pool, "billing", "no such text", 1000); err != nil || n != 0 || len(first) != 0 {
		t.Errorf("CountPoison without a match = %d, %v, %v", n, first, err)
	}
	// Capped: the count stops at max, and the delete with that limit takes those rows.
	n, first, err = f.admin.CountPoison(ctx, f.db.Pool, "billing", "timeout", 4)
	if err != nil || n != 4 || !slices.Equal(first, timeouts) {
		t.Fatalf("CountPoison capped at 4 = %d, %v, %v", n, first, err)
	}
	var deleted []int64
	if err := pgx.BeginFunc(ctx, f.db.Pool, func(tx pgx.Tx) error {
		var err error
		deleted, err = f.admin.DeletePoisonTx(ctx, tx, inbox.DeleteFilter{Consumer: "billing", ErrorContains: "timeout", Limit: 4})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(deleted, timeouts[:4]) {
		t.Errorf("DeletePoisonTx deleted %v, want the 4 counted first: %v", deleted, timeouts[:4])
	}
	n, first, err = f.admin.CountPoison(ctx, f.db.Pool, "billing", "timeout", 1000)
	if err != nil || n != 6 || !slices.Equal(first, timeouts[4:]) {
		t.Errorf("CountPoison after the delete = %d, %v, %v", n, first, err)
	}
	if _, err := f.admin.DeletePoisonTx(ctx, nil, inbox.DeleteFilter{}); !errors.Is(err, inbox.ErrEmptyDeleteFilter) {
		t.Errorf("DeletePoisonTx with an empty filter: %v", err)
	}
}

// PoisonSummary counts the rows that wait per consumer — given up, and replay requests with
// the oldest one's time — and leaves replayed rows out.
func TestAdminPoisonSummary(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newAdminFixture(t)
	if s, err := f.admin.PoisonSummary(ctx, f.db.Pool); err != nil || len(s) != 0 {
		t.Fatalf("PoisonSummary of an empty table = %+v, %v", s, err)
	}
	f.poison("billing", "x", inbox.StatePoison, nil)
	f.poison("billing", "x", inbox.StatePoison, nil)
	f.poison("billing", "x", inbox.StateReplayRequested, nil)
	f.poison("audit", "x", inbox.StatePoison, nil)
	f.poison("audit", "x", inbox.StateReplayed, nil)
	f.poison("history", "x", inbox.StateDuplicate, nil)
	s, err := f.admin.PoisonSummary(ctx, f.db.Pool)
	if err != nil || len(s) != 2 {
		t.Fatalf("PoisonSummary = %+v, %v", s, err)
	}
	if a := s[0]; a.Consumer != "audit" || a.Poison != 1 || a.ReplayRequested != 0 || !a.OldestRequest.IsZero() || a.OldestRequestAge() != 0 {
		t.Errorf("audit: %+v", a)
	}
	b := s[1]
	if b.Consumer != "billing" || b.Poison != 2 || b.ReplayRequested != 1 || b.OldestRequest.IsZero() ||
		b.OldestRequestAge() < 50*time.Second || b.OldestRequestAge() > 10*time.Minute {
		t.Errorf("billing: %+v (oldest request waited %s, want about a minute)", b, b.OldestRequestAge())
	}
}

// Processed finds a consumer's dedup row by key; Expired counts the rows the cleaner would
// delete — past the window, not a live saga's barrier row — up to a cap, and with the sagas
// elsewhere no barrier row at all. Each count is then what a cleaner deletes.
func TestAdminProcessedAndExpired(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newAdminFixture(t)
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := f.db.Pool.Exec(ctx, sql, args...); err != nil {
			t.Fatal(err)
		}
	}
	exec(`INSERT INTO ` + f.db.Table("saga") + ` (id, name, version, state, data, steps, finished_at) VALUES
		('live', 'checkout', 1, 'running', '{}', '[]', NULL), ('done', 'checkout', 1, 'completed', '{}', '[]', now())`)
	// Old: 3 plain rows, one barrier row of the live saga, one of the finished one, one of a
	// saga the table does not know. New: 2 plain rows.
	exec(`INSERT INTO ` + f.db.Table("processed_event") + ` (consumer, dedup_key, saga_id, processed_at) VALUES
		('billing', 'old-1', NULL, now() - interval '100 hours'), ('billing', 'old-2', NULL, now() - interval '100 hours'),
		('audit', 'old-3', NULL, now() - interval '80 hours'),
		('billing', 'barrier-live', 'live', now() - interval '100 hours'), ('billing', 'barrier-done', 'done', now() - interval '100 hours'),
		('billing', 'barrier-gone', 'gone', now() - interval '100 hours'),
		('billing', 'new-1', NULL, now() - interval '1 hour'), ('billing', 'new-2', NULL, now())`)

	at, ok, err := f.admin.Processed(ctx, f.db.Pool, "billing", "new-1")
	if err != nil || !ok || time.Since(at) < 50*time.Minute || time.Since(at) > 2*time.Hour {
		t.Errorf("Processed(billing, new-1) = %s, %t, %v", at, ok, err)
	}
	if at, ok, err := f.admin.Processed(ctx, f.db.Pool, "audit", "new-1"); err != nil || ok || !at.IsZero() {
		t.Errorf("Processed of another consumer's key = %s, %t, %v", at, ok, err)
	}

	for _, c := range []struct {
		window    time.Duration
		max       int64
		elsewhere bool
		want      int64
	}{
		{inbox.DefaultWindow, 100, false, 5}, // 3 plain, the finished saga's and the unknown saga's barrier rows
		{inbox.DefaultWindow, 2, false, 2},   // capped
		{inbox.DefaultWindow, 100, true, 3},  // barrier rows are asked of the other database
		{90 * time.Hour, 100, true, 2},
		{200 * time.Hour, 100, false, 0},
		{time.Minute, 100, false, 6},
	} {
		n, err := f.admin.Expired(ctx, f.db.Pool, c.window, c.max, c.elsewhere)
		if err != nil || n != c.want {
			t.Errorf("Expired(%s, max %d, elsewhere %t) = %d, %v; want %d", c.window, c.max, c.elsewhere, n, err, c.want)
		}
	}

	// The counts are what the cleaners delete: with the sagas elsewhere (every one alive, so
	// no barrier row goes), then here.
	clean := func(cfg inbox.CleanerConfig) int64 {
		t.Helper()
		cfg.Pool, cfg.Schema = f.db.Pool, f.db.Schema
		c, err := inbox.NewCleaner(cfg)
		if err != nil {
			t.Fatal(err)
		}
		n, err := c.Clean(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := clean(inbox.CleanerConfig{Sagas: func(_ context.Context, ids []string) ([]string, error) { return ids, nil }}); n != 3 {
		t.Errorf("the cleaner with the sagas elsewhere deleted %d rows; Expired counted 3", n)
	}
	if n := clean(inbox.CleanerConfig{}); n != 2 {
		t.Errorf("the cleaner deleted %d rows; Expired counted 2 more (the finished and the unknown saga's barrier rows)", n)
	}
	if n, err := f.admin.Expired(ctx, f.db.Pool, inbox.DefaultWindow, 100, false); err != nil || n != 0 {
		t.Errorf("Expired after the cleanup = %d, %v", n, err)
	}
	if _, ok, err := f.admin.Processed(ctx, f.db.Pool, "billing", "barrier-live"); err != nil || !ok {
		t.Errorf("the live saga's barrier row is gone (%t, %v)", ok, err)
	}
}
