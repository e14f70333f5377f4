package console_test

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/testdb"
)

// The versions page lists each definition version with its sagas not finished per state
// (linked to the filtered list), the oldest, and the live orchestrators; a version only an
// orchestrator registered is listed with zeros, a stale orchestrator is not.
func TestVersionsPage(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	s := seed(t, db)
	if _, err := db.Pool.Exec(context.Background(), `INSERT INTO `+db.Table("saga_orchestrator")+` (id, consumer, host, pid, definitions, expires_at) VALUES
		('live-1', 'onceflow-saga', 'web-1', 42, '[{"name": "checkout", "version": 2}]', now() + interval '30 seconds'),
		('dead-1', 'onceflow-saga', 'gone-host', 7, '[{"name": "checkout", "version": 1}]', now() - interval '1 second')`); err != nil {
		t.Fatal(err)
	}
	srv, _ := newServer(t, db, false)
	p := newBrowser(t, srv).get("/ops/versions").expect(t, "versions", http.StatusOK,
		`<table id="versions">`,
		`href="/ops/sagas?name=checkout&amp;state=stuck&amp;version=1"`,
		`none: these sagas do not advance`, // checkout 1: sagas alive, its only orchestrator stale
		`title="onceflow-saga, id live-1, last heartbeat `, `>web-1:42</span>`,
		`<td>checkout</td><td>2</td>
<td><a href="/ops/sagas?name=checkout&amp;state=running&amp;version=2">0</a></td>`,
		`class="on">Saga versions</a>`)
	// The oldest saga not finished is the stuck one whose id is markup: escaped.
	if !strings.Contains(p.body, ">evil-&lt;script&gt;") || strings.Contains(p.body, "<script") {
		t.Errorf("the versions page does not show the oldest saga, %q, escaped:\n%s", s.evil, p.body)
	}
	if strings.Contains(p.body, "gone-host") {
		t.Errorf("the versions page shows a stale orchestrator:\n%s", p.body)
	}
}
