package browsertest

import (
	"context"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/testdb"
)

// An operator, signed in with a credential: the overview, the stuck sagas, the stuck saga's
// page, its retry through the confirmation form, and the retry request in the database; the
// parked outbox row replayed after its dry run; the poison message's replay requested. Then
// the audit trail lists the three actions under the operator's name, and the saga's page
// shows its own.
func TestBrowserRecoveryAndAudit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := newTab(t)
	db := testdb.New(t)
	s := seed(t, db)
	srv, logs := newServer(t, db)
	b.login(operator, operatorPassword)

	if code := b.open(srv.URL + "/ops/"); code != http.StatusOK {
		b.fail("overview: status %d", code)
	}
	b.expectText("overview", "STUCK", "stuck sagas")
	b.screenshot("overview.png")

	b.click(`a.figure[href="/ops/sagas?state=stuck"]`, "/ops/sagas?state=stuck")
	if txt := b.expectText("stuck sagas", s.stuck); strings.Contains(txt, s.running) {
		b.fail("the stuck sagas list a running saga")
	}
	b.screenshot("sagas.png")

	b.click(`a[href="/ops/sagas/`+s.stuck+`"]`, "/ops/sagas/"+s.stuck)
	b.expectText("saga page", "stock service unavailable", s.stuckEvent)
	b.screenshot("saga.png")

	b.click("#retry", "/ops/sagas/"+s.stuck+"/retry")
	b.expectText("confirmation", "files a retry request")
	if code := b.click("#confirm", "requested=retry"); code != http.StatusOK {
		b.fail("after the retry: status %d", code)
	}
	b.expectText("after the retry", "Retry requested")
	if got := operatorRequests(t, db, "retry"); !slices.Equal(got, []string{s.stuck}) {
		t.Fatalf("retry requests in the database: %q, want [%s]", got, s.stuck)
	}
	if l := logs.String(); !strings.Contains(l, `action="saga retry"`) || !strings.Contains(l, "user="+operator) {
		t.Errorf("action log:\n%s", l)
	}

	// The parked row: the dry run's count, then the replay; the row is back in the outbox
	// with its event id.
	b.open(srv.URL + "/ops/outbox/parked")
	b.screenshot("parked.png")
	b.click("#replay-filter", "/ops/outbox/replay?all=1")
	b.expectText("replay dry run", "Dry run: 1 match")
	b.click("#confirm", "replayed=1")
	var topic string
	if err := db.Pool.QueryRow(ctx, `SELECT topic FROM `+db.Table("outbox")+` WHERE event_id = $1`, s.parkedEvent).Scan(&topic); err != nil || topic != "payments" {
		t.Fatalf("the replayed row is not in the outbox: %q, %v", topic, err)
	}

	// The poison message: from the inbox list to its page, the replay's confirmation, and the
	// request in the database (a process of consumer projection applies it; none runs here).
	b.open(srv.URL + "/ops/inbox")
	b.screenshot("inbox.png")
	id := strconv.FormatInt(s.poisonID, 10)
	b.click(`a[href="/ops/inbox/`+id+`"]`, "/ops/inbox/"+id)
	b.click("#replay", "/ops/inbox/"+id+"/replay")
	b.expectText("replay confirmation", "Dry run: 1 match", "exactly once")
	b.click("#confirm", "replayed=1")
	b.expectText("after the replay", "Replay requested", "replay_requested")
	b.screenshot("poison.png")
	var state, by string
	if err := db.Pool.QueryRow(ctx, `SELECT state, replay_requested_by FROM `+db.Table("inbox_poison")+` WHERE id = $1`, s.poisonID).Scan(&state, &by); err != nil ||
		state != "replay_requested" || by != "console:"+operator {
		t.Fatalf("the replay request is not in the database: state %q by %q, %v", state, by, err)
	}

	// The audit trail, newest first, each action under the credential's name with what it
	// acted on.
	b.click(`nav a[href="/ops/audit"]`, "/ops/audit")
	b.screenshot("audit.png")
	want := [][2]string{{"inbox replay", id}, {"outbox replay", s.parkedEvent}, {"saga retry", s.stuck}}
	rows := b.rows("table.audit")
	if len(rows) != len(want) {
		b.fail("audit trail: %d rows, want %d: %q", len(rows), len(want), rows)
	}
	for i, w := range want {
		// At, Who, Action, On, Filter, Outcome
		if r := rows[i]; len(r) != 6 || r[1] != operator || r[2] != w[0] || r[3] != w[1] {
			b.fail("audit trail row %d: %q, want %s by %s on %s", i, r, w[0], operator, w[1])
		}
	}
	// Its link leads to the saga, whose page lists the action on it.
	b.click(`table.audit a[href="/ops/sagas/`+s.stuck+`"]`, "/ops/sagas/"+s.stuck)
	if r := b.rows("#audit table.audit"); len(r) != 1 || len(r[0]) != 6 || r[0][1] != operator || r[0][2] != "saga retry" || r[0][5] != "requested" {
		b.fail("the saga page's audit section: %q, want one saga retry by %s", r, operator)
	}
}
