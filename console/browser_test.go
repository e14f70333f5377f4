package console_test

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testdb"
)

// In a real headless Chromium: open the overview, follow the stuck sagas to the stuck saga's
// page, retry it through the confirmation form, and find the retry request in the database;
// then replay the parked outbox row after its dry run.
// With ONCEFLOW_SCREENSHOTS set to a folder it writes the screenshots docs/console.md shows:
//
//	ONCEFLOW_SCREENSHOTS=$PWD/docs/console go test -run TestBrowserRetryStuckSaga ./console/
func TestBrowserRetryStuckSaga(t *testing.T) {
	t.Parallel()
	bin := findChromium(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	db := testdb.New(t)
	s := seed(t, db)
	srv, logs := newServer(t, db, true)
	shots := os.Getenv("ONCEFLOW_SCREENSHOTS")
	b := startChromium(t, bin)

	b.navigate(ctx, srv.URL+"/ops/")
	if txt := b.text(); !strings.Contains(txt, "STUCK") || !strings.Contains(txt, "stuck sagas") {
		t.Fatalf("overview:\n%s", txt)
	}
	b.screenshot(shots, "overview.png")

	b.click(ctx, `a.figure[href="/ops/sagas?state=stuck"]`, "/ops/sagas?state=stuck")
	if txt := b.text(); !strings.Contains(txt, s.stuck) || strings.Contains(txt, s.running) {
		t.Fatalf("stuck sagas:\n%s", txt)
	}
	b.screenshot(shots, "sagas.png")

	b.click(ctx, `a[href="/ops/sagas/`+s.stuck+`"]`, "/ops/sagas/"+s.stuck)
	if txt := b.text(); !strings.Contains(txt, "stock service unavailable") || !strings.Contains(txt, s.stuckEvent) {
		t.Fatalf("saga page:\n%s", txt)
	}
	b.screenshot(shots, "saga.png")

	b.click(ctx, "#retry", "/ops/sagas/"+s.stuck+"/retry")
	if txt := b.text(); !strings.Contains(txt, "files a retry request") {
		t.Fatalf("confirmation:\n%s", txt)
	}
	b.click(ctx, "#confirm", "requested=retry")
	if txt := b.text(); !strings.Contains(txt, "Retry requested") {
		t.Fatalf("after the retry:\n%s", txt)
	}

	var action string
	if err := db.Pool.QueryRow(ctx, `SELECT action FROM `+db.Table("saga_timer")+` WHERE saga_id = $1 AND kind = 'operator'`, s.stuck).Scan(&action); err != nil || action != "retry" {
		t.Fatalf("the retry request is not in the database: %q, %v", action, err)
	}
	if l := logs.String(); !strings.Contains(l, `action="saga retry"`) || !strings.Contains(l, "user=alice") {
		t.Errorf("action log:\n%s", l)
	}

	// The parked row: the dry run's count, then the replay; the row is back in the outbox
	// with its event id.
	b.navigate(ctx, srv.URL+"/ops/outbox/parked")
	b.screenshot(shots, "parked.png")
	b.click(ctx, "#replay-filter", "/ops/outbox/replay?all=1")
	if txt := b.text(); !strings.Contains(txt, "Dry run: 1 match") {
		t.Fatalf("replay dry run:\n%s", txt)
	}
	b.click(ctx, "#confirm", "replayed=1")
	var topic string
	if err := db.Pool.QueryRow(ctx, `SELECT topic FROM `+db.Table("outbox")+` WHERE event_id = $1`, s.parkedEvent).Scan(&topic); err != nil || topic != "payments" {
		t.Fatalf("the replayed row is not in the outbox: %q, %v", topic, err)
	}

	// The poison message: from the inbox list to its page, the replay's confirmation, and the
	// request in the database (a process of consumer projection applies it; none runs here).
	b.navigate(ctx, srv.URL+"/ops/inbox")
	b.screenshot(shots, "inbox.png")
	id := strconv.FormatInt(s.poisonID, 10)
	b.click(ctx, `a[href="/ops/inbox/`+id+`"]`, "/ops/inbox/"+id)
	b.click(ctx, "#replay", "/ops/inbox/"+id+"/replay")
	if txt := b.text(); !strings.Contains(txt, "Dry run: 1 match") || !strings.Contains(txt, "exactly once") {
		t.Fatalf("replay confirmation:\n%s", txt)
	}
	b.click(ctx, "#confirm", "replayed=1")
	if txt := b.text(); !strings.Contains(txt, "Replay requested") || !strings.Contains(txt, "replay_requested") {
		t.Fatalf("after the replay:\n%s", txt)
	}
	b.screenshot(shots, "poison.png")
	var state, by string
	if err := db.Pool.QueryRow(ctx, `SELECT state, replay_requested_by FROM `+db.Table("inbox_poison")+` WHERE id = $1`, s.poisonID).Scan(&state, &by); err != nil ||
		state != "replay_requested" || by != "console:alice" {
		t.Fatalf("the replay request is not in the database: state %q by %q, %v", state, by, err)
	}
	if l := logs.String(); !strings.Contains(l, `action="inbox poison replay"`) || !strings.Contains(l, "poison_id="+id) {
		t.Errorf("action log:\n%s", l)
	}
}
