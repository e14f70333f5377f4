package console_test

import (
	"context"
	"net/http"
	"testing"

	"github.com/onceflow/onceflow/internal/testdb"
)

// A saga with a reply parked for lack of its definition version: its page says it awaits an
// orchestrator with that version, and the overview counts the parked replies per version.
func TestAwaitingVersionPages(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	ctx := context.Background()
	for _, sql := range []string{
		`INSERT INTO ` + db.Table("saga") + ` (id, name, version, state, step, waiting, data, steps)
			VALUES ('order-v2', 'checkout', 2, 'running', 0, 'reply', '{}', '[{"name": "reserve", "status": "running", "attempts": 1}]')`,
		`INSERT INTO ` + db.Table("saga_parked") + ` (saga_id, dedup_key, message_uuid, metadata, payload, name, version)
			VALUES ('order-v2', 'order-v2/reserve/action/1', 'u-1', '{"saga_id": "order-v2"}', '{}', 'checkout', 2)`,
	} {
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%v\n%s", err, sql)
		}
	}
	srv, _ := newServer(t, db, false)
	b := newBrowser(t, srv)
	b.get("/ops/sagas/order-v2").expect(t, "saga page", http.StatusOK,
		`id="awaiting-version">an orchestrator with definition checkout version 2 registered`, "1 reply of this saga", `id="wait">version`)
	b.get("/ops/").expect(t, "overview", http.StatusOK, `id="awaiting-version"`, "<td>checkout</td><td>2</td><td>1</td>",
		`href="/ops/sagas?name=checkout&amp;state=running&amp;version=2"`)
}
