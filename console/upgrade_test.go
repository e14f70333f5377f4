package console_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/saga"
)

// orderV1 and orderV2 are the seeded checkout saga's data in versions 1 and 2.
type orderV1 struct {
	Order string `json:"order"`
	Note  string `json:"note"`
}

type orderV2 struct {
	Order    string `json:"order"`
	Note     string `json:"note"`
	Currency string `json:"currency"`
}

// checkoutV2 renames reserve to reserve-stock and takes over version 1's sagas.
var checkoutV2 = saga.MustDefine("checkout", 2, []*saga.StepDef[orderV2]{
	saga.Step[orderV2]("reserve-stock").Send("reserve", func(o orderV2) (any, error) { return o, nil }).
		Compensate("release", func(o orderV2) (any, error) { return o, nil }),
	saga.Step[orderV2]("charge").Send("charge", func(o orderV2) (any, error) { return o, nil }),
}, saga.Upgrade(1, func(o orderV1) (orderV2, error) {
	return orderV2{Order: o.Order, Note: o.Note, Currency: "EUR"}, nil
}, saga.StepMap{"reserve": "reserve-stock"}))

// seedBoundary adds a checkout v1 saga at a step boundary (waiting to re-send charge) and a
// refund v1 saga at a boundary, and returns their ids.
func seedBoundary(t *testing.T, db *testdb.DB) (checkout, refund string) {
	t.Helper()
	at := time.Now().Add(-time.Hour).UTC()
	steps, _ := json.Marshal([]saga.StepHistory{{Name: "reserve", Status: "done", Attempts: 1, StartedAt: &at, FinishedAt: &at},
		{Name: "charge", Status: "running", Attempts: 1, StartedAt: &at}})
	for _, s := range []struct{ id, name string }{{"order-boundary", "checkout"}, {"refund-boundary", "refund"}} {
		if _, err := db.Pool.Exec(context.Background(), `INSERT INTO `+db.Table("saga")+` (id, name, version, state, step, attempt, waiting, data, steps, created_at, updated_at)
			VALUES ($1, $2, 1, 'running', 1, 1, 'resend', '{"order": "o-9", "note": "n"}', $3, $4, $4)`, s.id, s.name, steps, at); err != nil {
			t.Fatal(err)
		}
		if _, err := db.Pool.Exec(context.Background(), `INSERT INTO `+db.Table("saga_timer")+` (saga_id, kind, step, phase, attempt, action, due_at)
			VALUES ($1, 'step', 1, 'action', 1, 'resend', now() + interval '5 minutes')`, s.id); err != nil {
			t.Fatal(err)
		}
	}
	return "order-boundary", "refund-boundary"
}

// The upgrade page is a dry run first: the sagas of the version at a step boundary (with their
// step mapping and converted data when the console has the definitions) and the others with
// the reason. Confirming files a request for the sagas shown, each checked again: a saga of
// another definition slipped into the form is refused, and nothing is filed for it.
func TestUpgradePage(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	s := seed(t, db)
	checkout, refund := seedBoundary(t, db)
	srv, logs := newServer(t, db, true, checkoutV2)
	b := newBrowser(t, srv)

	b.get("/ops/versions").expect(t, "versions", http.StatusOK, `href="/ops/versions/checkout/1/upgrade">Upgrade…</a>`)
	dry := b.get("/ops/versions/checkout/1/upgrade").expect(t, "dry run", http.StatusOK,
		`<table id="boundary">`, `>order-boundary</a></td><td>charge</td>`,
		`<td>charge</td><td>reserve → reserve-stock (done); charge (running)</td>`, `&#34;currency&#34;: &#34;EUR&#34;`,
		s.running+`: it waits for the reply to step charge`, s.stuck+`: it is stuck compensating step reserve`,
		`name="saga" value="order-boundary"`, `File upgrade requests for the sagas above (1)`)
	if strings.Contains(dry.body, refund) {
		t.Errorf("the dry run of checkout lists a refund saga:\n%s", dry.body)
	}
	if n := countRows(t, db, `SELECT count(*) FROM `+db.Table("saga_timer")+` WHERE kind = 'operator'`); n != 0 {
		t.Fatalf("the dry run filed %d requests", n)
	}

	b.post("/ops/versions/checkout/1/upgrade", url.Values{"csrf": {dry.csrf(t)}, "saga": {checkout, refund}}).expect(t, "upgrade", http.StatusOK,
		`id="filed">1 of 2 upgrade requests filed`, `>order-boundary</a></li>`, refund+`: it is a refund saga, not checkout`)
	if n := countRows(t, db, `SELECT count(*) FROM `+db.Table("saga_timer")+` WHERE kind = 'operator' AND action = 'upgrade' AND saga_id = '`+checkout+`' AND step = 1`); n != 1 {
		t.Errorf("%d upgrade requests filed for %s, want 1", n, checkout)
	}
	if n := countRows(t, db, `SELECT count(*) FROM `+db.Table("saga_timer")+` WHERE kind = 'operator' AND saga_id <> '`+checkout+`'`); n != 0 {
		t.Errorf("%d requests filed for other sagas", n)
	}
	if l := logs.String(); !strings.Contains(l, `action="saga upgrade"`) || !strings.Contains(l, "user=alice") {
		t.Errorf("the action log has no line for the upgrade:\n%s", l)
	}

	// Bad input is refused and files nothing.
	tok := dry.csrf(t)
	b.post("/ops/versions/checkout/1/upgrade", url.Values{"csrf": {tok}}).expect(t, "no ids", http.StatusBadRequest, "1 to 100")
	b.post("/ops/versions/checkout/x/upgrade", url.Values{"csrf": {tok}, "saga": {checkout}}).expect(t, "bad version", http.StatusBadRequest, "not a positive number")
	b.get("/ops/versions/checkout/1/upgrade?to=1").expect(t, "bad target", http.StatusBadRequest, "not a number above 1")
	b.get("/ops/versions/nothing/1/upgrade").expect(t, "no sagas", http.StatusOK, `No saga of nothing version 1 is unfinished`)
}

// Without the definitions the dry run still tells which sagas are at a boundary, says the
// mapping is the orchestrator's to check, and a read-only console offers no button.
func TestUpgradePageWithoutDefinitions(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	seed(t, db)
	seedBoundary(t, db)
	srv, _ := newServer(t, db, false)
	p := newBrowser(t, srv).get("/ops/versions/checkout/1/upgrade").expect(t, "dry run", http.StatusOK,
		`>order-boundary</a></td><td>charge</td>`, "was not given the definitions", "read-only")
	if strings.Contains(p.body, `id="confirm"`) {
		t.Errorf("a read-only console offers the upgrade:\n%s", p.body)
	}
}

func countRows(t *testing.T, db *testdb.DB, sql string) int {
	t.Helper()
	var n int
	if err := db.Pool.QueryRow(context.Background(), sql).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}
