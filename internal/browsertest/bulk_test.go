package browsertest

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

// A bulk action on a list that changed between its confirmation and the click: five
// checkout sagas run their "charge" step; the operator opens the bulk compensation of the
// sagas at that step; meanwhile two of them move on to "ship" and two new ones reach
// "charge". Confirming acts on the five it showed, only where they still match: the result
// page says "requested for 3 of the 5 sagas shown, 2 skipped" with each skipped saga's
// reason, the database holds requests for those three only — none for the two that moved
// on, none for the two it never showed — and the audit trail records those three.
func TestBrowserBulkOnChangedList(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := newTab(t)
	db := testdb.New(t)
	srv, logs := newServer(t, db)
	at := seedTime()
	atCharge := func(id string, started time.Time) {
		insertSaga(t, db, sagaRow{id: id, state: "running", step: 1, createdAt: started, steps: []saga.StepHistory{
			step(started, "reserve", "done", command(started, "reserve", outbox.SagaPhaseAction, 1, "")),
			step(started, "charge", "running", command(started, "charge", outbox.SagaPhaseAction, 1, "")),
			step(started, "ship", "pending")}})
	}
	var shown []string
	for i := 1; i <= 5; i++ {
		id := fmt.Sprintf("order-%d", i)
		atCharge(id, at.Add(time.Duration(i)*time.Minute))
		shown = append(shown, id)
	}
	b.login(operator, operatorPassword)

	if code := b.open(srv.URL + "/ops/sagas?step=charge"); code != http.StatusOK {
		b.fail("the sagas at step charge: status %d", code)
	}
	b.expectText("the sagas at step charge", shown...)
	b.click("#bulk-compensate", "/ops/bulk/sagas/compensate?step=charge")
	b.expectText("the bulk compensation's dry run", "Dry run: 5 match", strings.Join([]string{"order-5", "order-4", "order-3", "order-2", "order-1"}, ", "))

	// While the confirmation is open: two sagas take their next step, two new ones reach
	// the step.
	moved := []string{"order-2", "order-4"}
	if _, err := db.Pool.Exec(ctx, `UPDATE `+db.Table("saga")+` SET step = 2, updated_at = now(),
		steps = jsonb_set(jsonb_set(steps, '{1,status}', '"done"'), '{2,status}', '"running"') WHERE id = ANY($1)`, moved); err != nil {
		t.Fatal(err)
	}
	atCharge("order-6", time.Now().Add(-time.Second))
	atCharge("order-7", time.Now())

	if code := b.click("#confirm", "/ops/bulk/sagas/compensate"); code != http.StatusOK {
		b.fail("the bulk compensation's result: status %d", code)
	}
	txt := b.expectText("the bulk compensation's result", "Compensate: requested for 3 of the 5 sagas shown, 2 skipped")
	for _, id := range moved {
		if want := id + ": is at step ship now, not charge"; !strings.Contains(txt, want) {
			b.fail("the result lacks the reason %q", want)
		}
	}
	if strings.Contains(txt, "order-6") || strings.Contains(txt, "order-7") {
		b.fail("the result names sagas the confirmation never showed")
	}
	if got, want := operatorRequests(t, db, "compensate"), []string{"order-1", "order-3", "order-5"}; !slices.Equal(got, want) {
		t.Fatalf("compensation requests in the database: %q, want %q", got, want)
	}
	// The audit trail has one record per saga requested, with the filter that selected it.
	b.click(`nav a[href="/ops/audit"]`, "/ops/audit")
	var audited []string
	for _, r := range b.rows("table.audit") {
		if len(r) != 6 || r[1] != operator || r[2] != "saga compensate" || r[4] != `step "charge"` || r[5] != "requested" {
			b.fail("audit trail row %q, want a saga compensate by %s with the filter step \"charge\"", r, operator)
		}
		audited = append(audited, r[3])
	}
	if slices.Sort(audited); !slices.Equal(audited, []string{"order-1", "order-3", "order-5"}) {
		b.fail("the audit trail records compensations of %q", audited)
	}
	if l := logs.String(); !strings.Contains(l, `action="saga bulk compensate"`) || !strings.Contains(l, "requested=3") || !strings.Contains(l, "refused=2") {
		t.Errorf("action log:\n%s", l)
	}
}
