package saga_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/saga"
)

// A bulk request acts on what was shown: 150 running sagas at step reserve are listed (dry
// run); then 10 of them move on to charge and 20 new ones start at reserve. Confirming with
// the listed ids requests only the 140 still at reserve, refuses the 10 with the reason, and
// never touches the 20 that were not shown.
func TestBulkActsOnlyOnWhatWasShown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	insert := func(from, to int) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("saga")+` (id, name, version, state, step, attempt, waiting, data, steps, created_at, updated_at)
			SELECT 'o-' || lpad(g::text, 3, '0'), 'checkout', 1, 'running', 0, 1, 'reply', '{}',
				'[{"name": "reserve", "status": "running", "attempts": 1}, {"name": "charge", "status": "pending"}]', now() - interval '1 hour', now()
			FROM generate_series($1::int, $2::int) g`, from, to); err != nil {
			t.Fatal(err)
		}
	}
	insert(1, 150)
	admin, err := saga.NewAdmin(db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	f := saga.ListFilter{State: saga.StateRunning, Step: "reserve"}
	shown, err := admin.CompensateMatching(ctx, db.Pool, f, saga.BulkOptions{DryRun: true, Limit: 200})
	if err != nil || len(shown.Matched) != 150 {
		t.Fatalf("dry run: %d matched, %v", len(shown.Matched), err)
	}
	// Meanwhile: 10 listed sagas move on to charge; 20 new ones start at reserve.
	if _, err := db.Pool.Exec(ctx, `UPDATE `+db.Table("saga")+` SET step = 1,
		steps = '[{"name": "reserve", "status": "done", "attempts": 1}, {"name": "charge", "status": "running", "attempts": 1}]'
		WHERE id BETWEEN 'o-001' AND 'o-010'`); err != nil {
		t.Fatal(err)
	}
	insert(151, 170)

	res, err := admin.CompensateMatching(ctx, db.Pool, f, saga.BulkOptions{IDs: shown.Matched, Limit: 200})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Requested) != 140 || len(res.Refused) != 10 {
		t.Fatalf("requested %d, refused %d; want 140 and 10", len(res.Requested), len(res.Refused))
	}
	for _, r := range res.Refused {
		if !errors.Is(r.Err, saga.ErrNoLongerMatches) || !errors.Is(r.Err, saga.ErrWrongState) || !strings.Contains(r.Err.Error(), "is at step charge now, not reserve") {
			t.Errorf("refusal of %s: %v", r.ID, r.Err)
		}
	}
	var requested, unshown, moved int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE saga_id > 'o-150'), count(*) FILTER (WHERE saga_id <= 'o-010')
		FROM `+db.Table("saga_timer")+` WHERE kind = 'operator' AND action = 'compensate'`).Scan(&requested, &unshown, &moved); err != nil {
		t.Fatal(err)
	}
	if requested != 140 || unshown != 0 || moved != 0 {
		t.Fatalf("compensation requests: %d in all, %d for sagas never shown, %d for sagas that moved on; want 140, 0, 0", requested, unshown, moved)
	}
	if _, err := admin.RetryMatching(ctx, db.Pool, f, saga.BulkOptions{IDs: shown.Matched, Limit: 100}); !errors.Is(err, saga.ErrBadFilter) {
		t.Errorf("more ids than the limit: %v", err)
	}
}

// A filter no index answers (the step, the error, an id prefix) reads at most MaxListScan
// sagas per page: a saga that matches far down is found by following Next, page after page,
// each of which says how far it searched.
func TestListScansBoundedPages(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	n := saga.MaxListScan*2 + 10
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("saga")+` (id, name, version, state, step, data, steps, created_at, updated_at)
		SELECT 's-' || lpad(g::text, 7, '0'), 'checkout', 1, 'completed', 0, '{}',
			CASE WHEN g = $1 THEN '[{"name": "rare", "status": "done"}]' ELSE '[{"name": "reserve", "status": "done"}]' END::jsonb,
			now() - (g || ' seconds')::interval, now()
		FROM generate_series(1, $1::int) g`, n); err != nil {
		t.Fatal(err)
	}
	admin, err := saga.NewAdmin(db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	f := saga.ListFilter{Step: "rare", Limit: 10}
	var pages []string
	for range 5 {
		p, err := admin.ListPage(ctx, db.Pool, f)
		if err != nil {
			t.Fatal(err)
		}
		pages = append(pages, fmt.Sprintf("%d found, searched %d, next %v", len(p.Sagas), p.Searched, p.Next != ""))
		if len(p.Sagas) == 1 {
			if p.Sagas[0].ID != fmt.Sprintf("s-%07d", n) { // the oldest
				t.Fatalf("found %s", p.Sagas[0].ID)
			}
			break
		}
		f.After = p.Next
	}
	want := fmt.Sprintf("[0 found, searched %d, next true 0 found, searched %d, next true 1 found, searched 0, next false]", saga.MaxListScan, saga.MaxListScan)
	if got := fmt.Sprint(pages); got != want {
		t.Fatalf("pages: %s\nwant   %s", got, want)
	}
	// A filter that matches densely fills its page at once.
	p, err := admin.ListPage(ctx, db.Pool, saga.ListFilter{Step: "reserve", Limit: 10})
	if err != nil || len(p.Sagas) != 10 || p.Searched != 0 || p.Next == "" {
		t.Fatalf("dense filter: %d sagas, searched %d, next %q, %v", len(p.Sagas), p.Searched, p.Next, err)
	}
}
