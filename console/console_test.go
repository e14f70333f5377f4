package console_test

import (
	"context"
	"html"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/console"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/saga"
)

// Every page renders from a database seeded with sagas in every state, pending and parked
// outbox rows, a poison message and an idempotency record, and shows what an operator looks
// for on it.
func TestPages(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	s := seed(t, db)
	srv, _ := newServer(t, db, false)
	b := newBrowser(t, srv)
	esc := url.PathEscape
	for _, tc := range []struct {
		path string
		want []string
	}{
		{"/ops/", []string{`id="verdict" class="stuck">STUCK`, "2 sagas stuck", `<b id="stuck">2</b>`, `<b id="parked">1</b>`, "relay-a", "projection",
			`href="/ops/sagas?name=checkout&amp;state=stuck"`, `<meta http-equiv="refresh" content="10">`,
			"1 row parked (over 0)", "1 inbox message given up as poison (over 0)"}},
		{"/ops/sagas", []string{s.stuck, s.running, s.compensating, s.completed, s.compensated}},
		{"/ops/sagas?state=stuck", []string{s.stuck, "stock service unavailable"}},
		{"/ops/sagas?state=running&name=checkout&version=1&step=charge&older=30m&id=order-", []string{s.running}},
		{"/ops/sagas?error=CARD+DECLINED", []string{s.compensating, s.compensated}},
		{"/ops/sagas/" + s.stuck, []string{`id="state">stuck`, "stock service unavailable", s.stuckEvent, "compensation command, attempt 3", "action reply, attempt 1: done", s.stuckReply, "compensation reply, attempt 3: retry",
			"4bf92f3577b34da6a3ce929d0e0e4736", `id="wait">operator`, "read-only", "inventory", "the action ran and took effect"}},
		{"/ops/sagas/" + s.running, []string{"timeout", "<td>in ", `id="wait">`, "No participant has recorded a barrier row"}},
		{"/ops/sagas/" + s.compensating, []string{`id="barriers"`, "payments", "a null compensation", "the compensation was decided"}},
		{"/ops/sagas/" + s.stuck + "/retry", []string{"Retry saga", "read-only"}},
		{"/ops/outbox", []string{"orders", "o-1", "o-2", "payments"[:0], `id="scheduled-rows">1</b> scheduled`, `id="scheduled-overdue">0</b> overdue`,
			s.scheduledEvent, "in 1h30m", `href="/ops/outbox?scheduled_topic=reminders#scheduled"`}},
		{"/ops/outbox?scheduled_topic=reminders", []string{"Topic reminders, in due order", s.scheduledEvent}},
		{"/ops/outbox?scheduled_topic=nosuch", []string{"No scheduled messages of topic nosuch"}},
		{"/ops/outbox/find?event_id=" + s.scheduledEvent, []string{`id="where">Scheduled: due`, "reminders"}},
		{"/ops/outbox?topic=orders&key=o-1", []string{s.pendingEvent, "broker down"}},
		{"/ops/outbox/find?event_id=" + s.pendingEvent, []string{`id="where">Pending in the outbox`}},
		{"/ops/outbox/find?event_id=" + s.parkedEvent, []string{`id="where">Parked since`, "MESSAGE_TOO_LARGE"}},
		{"/ops/outbox/find?event_id=0190b5a0-0000-7000-8000-000000000000", []string{"it was published"}},
		{"/ops/outbox/parked", []string{s.parkedEvent, "MESSAGE_TOO_LARGE", "relay-a"[:0]}},
		{"/ops/outbox/replay?topic=payments", []string{`<b>1</b> match: 9001`, "9001", "read-only"}},
		{"/ops/inbox", []string{"projection", "orders/0@42", `id="retry-lane"`, "No messages are parked in a retry lane."}},
		{"/ops/inbox?consumer=projection", []string{"orders/0@42"}},
		{"/ops/inbox/" + strconv.FormatInt(s.poisonID, 10), []string{"orders/0@42", "k-1", "saga_id"}},
		{"/ops/idempotency?owner=orders-api&key=key-1", []string{"<b>201</b>", "application/json", `&#34;order&#34;: &#34;o-1&#34;`}},
		{"/ops/idempotency?owner=orders-api", []string{"key-1"}},
		{"/ops/idempotency?owner=orders-api&key=nope", []string{"No record of key"}},
		{"/ops/sagas/" + esc(s.evil), []string{"evil-&lt;script&gt;"}},
	} {
		p := b.get(tc.path).expect(t, tc.path, http.StatusOK, tc.want...)
		if strings.Contains(p.body, "<script") {
			t.Errorf("%s: unescaped markup on the page", tc.path)
		}
		if csp := p.header.Get("Content-Security-Policy"); !strings.Contains(csp, "default-src 'none'") || strings.Contains(csp, "script-src") {
			t.Errorf("%s: Content-Security-Policy %q", tc.path, csp)
		}
		if strings.Contains(p.body, db.URL) || strings.Contains(p.body, "postgres://") {
			t.Errorf("%s: the page shows a connection string", tc.path)
		}
	}
}

// Invalid ids and filters get a 400 page that says what is wrong, and change nothing.
func TestBadInput(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	s := seed(t, db)
	srv, _ := newServer(t, db, true)
	b := newBrowser(t, srv)
	before := snapshot(t, db)
	for _, tc := range []struct{ path, want string }{
		{"/ops/sagas?state=exploded", `state &#34;exploded&#34; is not a saga state`},
		{"/ops/sagas?version=x", "is not a definition version"},
		{"/ops/sagas?older=yesterday", "is not a positive duration"},
		{"/ops/sagas?limit=0", "is not a number between 1 and 1000"},
		{"/ops/sagas?after=bogus!", "is not one a page of sagas returned"},
		{"/ops/sagas?name=" + strings.Repeat("x", 600), "at most 512"},
		{"/ops/sagas/a%01b", "control characters"},
		{"/ops/sagas/" + s.completed + "/retry", ""},
		{"/ops/outbox/find?event_id=42", "is not a UUID"},
		{"/ops/outbox?scheduled_after=nope", `scheduled_after &#34;nope&#34; is not a cursor`},
		{"/ops/outbox/replay", "choose the parked rows to replay"},
		{"/ops/outbox/replay?id=1,x", `id &#34;x&#34; is not a row id`},
		{"/ops/inbox/abc", "is not a poison row id"},
		{"/ops/inbox?before=-1", "is not a row id"},
		{"/ops/idempotency?key=k", "keys are scoped per owner"},
	} {
		want := http.StatusBadRequest
		if strings.HasSuffix(tc.path, "/retry") {
			// A confirmation page that refuses: 200 with the reason, and no button.
			b.get(tc.path).expect(t, tc.path, http.StatusOK, `id="refusal"`, "only a stuck saga")
			continue
		}
		b.get(tc.path).expect(t, tc.path, want, tc.want, "Nothing was changed")
	}
	tok := b.get("/ops/sagas/" + s.stuck + "/retry").csrf(t)
	for _, tc := range []struct {
		path string
		form url.Values
		code int
		want string
	}{
		{"/ops/sagas/" + s.completed + "/retry", nil, http.StatusBadRequest, "only a stuck saga can be retried"},
		{"/ops/sagas/" + s.running + "/retry", nil, http.StatusBadRequest, "only a stuck saga can be retried"},
		{"/ops/sagas/" + s.stuck + "/compensate", nil, http.StatusBadRequest, "only a running saga can be compensated"},
		{"/ops/sagas/nope/retry", nil, http.StatusNotFound, "no saga with this id"},
		{"/ops/sagas/" + s.stuck + "/explode", nil, http.StatusNotFound, "no page"},
		{"/ops/outbox/replay", url.Values{"topic": {"no-such-topic"}}, http.StatusBadRequest, "nothing was moved"},
		{"/ops/outbox/replay", url.Values{"id": {"0"}}, http.StatusBadRequest, "is not a row id"},
		{"/ops/outbox/replay", url.Values{}, http.StatusBadRequest, "choose the parked rows"},
		{"/ops/inbox/999999/delete", nil, http.StatusBadRequest, "nothing was deleted"},
	} {
		f := url.Values{"csrf": {tok}}
		for k, v := range tc.form {
			f[k] = v
		}
		b.post(tc.path, f).expect(t, "POST "+tc.path, tc.code, tc.want)
	}
	if after := snapshot(t, db); after != before {
		t.Errorf("bad input changed the database:\nbefore %s\nafter  %s", before, after)
	}
}

// snapshot summarises every table an action could change.
func snapshot(t testing.TB, db *testdb.DB) string {
	t.Helper()
	var out string
	err := db.Pool.QueryRow(context.Background(), `SELECT concat_ws(' ',
		(SELECT count(*) FROM `+db.Table("saga_timer")+`), (SELECT string_agg(id || ':' || state, ',' ORDER BY id) FROM `+db.Table("saga")+`),
		(SELECT count(*) FROM `+db.Table("outbox")+`), (SELECT count(*) FROM `+db.Table("outbox_parked")+`),
		(SELECT count(*) FROM `+db.Table("inbox_poison")+`))`).Scan(&out)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// A read-only console shows no action button and refuses every POST, even with a valid CSRF
// token; nothing changes.
func TestReadOnlyRefusesActions(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	s := seed(t, db)
	srv, _ := newServer(t, db, false)
	b := newBrowser(t, srv)
	p := b.get("/ops/sagas/"+s.stuck).expect(t, "saga page", http.StatusOK)
	if strings.Contains(p.body, `id="retry"`) {
		t.Error("a read-only console shows the retry button")
	}
	before := snapshot(t, db)
	// The token a read-only console still hands out (its cookie is set on every page).
	tok := regexpCookie(t, b, srv)
	for _, path := range []string{"/ops/sagas/" + s.stuck + "/retry", "/ops/sagas/" + s.running + "/compensate", "/ops/outbox/replay",
		"/ops/inbox/" + strconv.FormatInt(s.poisonID, 10) + "/delete", "/ops/inbox/" + strconv.FormatInt(s.poisonID, 10) + "/replay",
		"/ops/inbox/replay?consumer=projection"} {
		b.post(path, url.Values{"csrf": {tok}, "all": {"1"}}).expect(t, "POST "+path, http.StatusForbidden, "read-only")
	}
	if after := snapshot(t, db); after != before {
		t.Errorf("a read-only console changed the database:\nbefore %s\nafter  %s", before, after)
	}
}

func regexpCookie(t testing.TB, b *browser, srv *httptest.Server) string {
	t.Helper()
	u, _ := url.Parse(srv.URL + "/ops/")
	for _, c := range b.c.Jar.Cookies(u) {
		if c.Name == "onceflow_csrf" {
			return c.Value
		}
	}
	t.Fatal("no CSRF cookie")
	return ""
}

// A POST without the CSRF token, with another one, or from another site is refused and
// changes nothing; with it, the action is carried out and logged with the user's name.
func TestCSRFAndActionLog(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	s := seed(t, db)
	srv, logs := newServer(t, db, true)
	b := newBrowser(t, srv)
	confirm := b.get("/ops/sagas/"+s.stuck+"/retry").expect(t, "retry confirmation", http.StatusOK, "Retry saga", "fresh"[:0])
	tok := confirm.csrf(t)
	path := "/ops/sagas/" + s.stuck + "/retry"
	before := snapshot(t, db)
	b.post(path, url.Values{}).expect(t, "POST without token", http.StatusForbidden, "CSRF token")
	b.post(path, url.Values{"csrf": {strings.Repeat("ab", 32)}}).expect(t, "POST with another token", http.StatusForbidden, "CSRF token")
	b.post(path, url.Values{"csrf": {tok}}, "Origin", "https://evil.example").expect(t, "POST from another site", http.StatusForbidden, "another site")
	b.post(path, url.Values{"csrf": {tok}}, "Origin", "null").expect(t, "POST with Origin: null", http.StatusForbidden, "without its origin")
	b.post(path, url.Values{"csrf": {tok}}, "Origin", "").expect(t, "POST without Origin", http.StatusForbidden, "without its origin")
	stranger := newBrowser(t, srv) // no cookie: a forged form on another site
	stranger.post(path, url.Values{"csrf": {tok}}).expect(t, "POST without the cookie", http.StatusForbidden, "CSRF token")
	if after := snapshot(t, db); after != before {
		t.Fatalf("refused POSTs changed the database:\nbefore %s\nafter  %s", before, after)
	}

	p := b.post(path, url.Values{"csrf": {tok}}, "Origin", srv.URL)
	if p.status != http.StatusSeeOther || !strings.HasSuffix(p.header.Get("Location"), "/ops/sagas/"+s.stuck+"?requested=retry") {
		t.Fatalf("POST retry: %d %v\n%s", p.status, p.header, p.body)
	}
	var action string
	if err := db.Pool.QueryRow(ctx, `SELECT action FROM `+db.Table("saga_timer")+` WHERE saga_id = $1 AND kind = 'operator'`, s.stuck).Scan(&action); err != nil || action != "retry" {
		t.Fatalf("operator request after retry: %q, %v", action, err)
	}
	b.get("/ops/sagas/"+s.stuck+"?requested=retry").expect(t, "saga page after retry", http.StatusOK, `id="requested">Retry requested`,
		`<div id="audit">`, "<td>alice</td><td>saga retry</td>")
	b.get("/ops/audit").expect(t, "audit trail", http.StatusOK, "<td>alice</td><td>saga retry</td>", `href="/ops/sagas/`+s.stuck+`"`, "<td>requested</td>",
		`class="on">Audit</a>`)
	if l := logs.String(); !strings.Contains(l, "user=alice") || !strings.Contains(l, `action="saga retry"`) || !strings.Contains(l, "saga_id="+s.stuck) {
		t.Errorf("action log:\n%s", l)
	}

	// Compensate a running saga.
	b.post("/ops/sagas/"+s.running+"/compensate", url.Values{"csrf": {tok}}).expect(t, "POST compensate", http.StatusSeeOther)
	if err := db.Pool.QueryRow(ctx, `SELECT action FROM `+db.Table("saga_timer")+` WHERE saga_id = $1 AND kind = 'operator'`, s.running).Scan(&action); err != nil || action != "compensate" {
		t.Fatalf("operator request after compensate: %q, %v", action, err)
	}
}

// Replay of parked rows shows the dry-run count first, then moves the rows back with their
// event id and a fresh created_at; a second replay of the same filter moves nothing and says
// so. A handled poison row is deleted.
func TestReplayParkedAndDeletePoison(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	s := seed(t, db)
	srv, logs := newServer(t, db, true)
	b := newBrowser(t, srv)
	b.get("/ops/outbox/parked").expect(t, "parked", http.StatusOK, `id="replay-filter"`, "?all=1")
	dry := b.get("/ops/outbox/replay?topic=payments").expect(t, "replay dry run", http.StatusOK, `id="count">Dry run: <b>1</b> match: 9001`, "9001", `name="topic" value="payments"`)
	p := b.post("/ops/outbox/replay", url.Values{"csrf": {dry.csrf(t)}, "topic": {"payments"}})
	if p.status != http.StatusSeeOther {
		t.Fatalf("POST replay: %d\n%s", p.status, p.body)
	}
	b.get(p.header.Get("Location")).expect(t, "after replay", http.StatusOK, "1 parked rows moved back")
	var age time.Duration
	if err := db.Pool.QueryRow(ctx, `SELECT now() - created_at FROM `+db.Table("outbox")+` WHERE event_id = $1`, s.parkedEvent).Scan(&age); err != nil {
		t.Fatalf("the replayed row is not in the outbox: %v", err)
	}
	if age > time.Minute {
		t.Errorf("the replayed row kept its old created_at (%s old): status would call it stuck", age)
	}
	b.post("/ops/outbox/replay", url.Values{"csrf": {dry.csrf(t)}, "topic": {"payments"}}).expect(t, "second replay", http.StatusBadRequest, "nothing was moved")
	if !strings.Contains(logs.String(), `action="outbox replay"`) || !strings.Contains(logs.String(), "moved=1") {
		t.Errorf("action log:\n%s", logs.String())
	}

	id := strconv.FormatInt(s.poisonID, 10)
	conf := b.get("/ops/inbox/"+id+"/delete").expect(t, "delete confirmation", http.StatusOK, "Its dedup row stays")
	b.post("/ops/inbox/"+id+"/delete", url.Values{"csrf": {conf.csrf(t)}}).expect(t, "delete", http.StatusSeeOther)
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Table("inbox_poison")).Scan(&n); err != nil || n != 0 {
		t.Fatalf("poison rows after delete: %d, %v", n, err)
	}
	b.get("/ops/inbox/"+id).expect(t, "deleted row", http.StatusNotFound, "deleted already")
}

// The saga list pages by keyset: 250 sagas in pages of 100 come out once each, newest first,
// with a filter kept across pages.
func TestSagaListKeyset(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	// Many sagas share a created_at (one statement), so the id breaks the ties.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("saga")+` (id, name, version, state, data, steps, created_at)
		SELECT 's-' || lpad(i::text, 4, '0'), 'checkout', 1, CASE WHEN i % 2 = 0 THEN 'stuck' ELSE 'running' END, '{}', '[]',
		       timestamptz '2026-01-01' + (i / 10) * interval '1 second'
		FROM generate_series(1, 500) i`); err != nil {
		t.Fatal(err)
	}
	srv, _ := newServer(t, db, false)
	b := newBrowser(t, srv)
	seen := map[string]bool{}
	next := "/ops/sagas?state=stuck&limit=100"
	pages := 0
	for next != "" {
		p := b.get(next).expect(t, next, http.StatusOK)
		pages++
		for _, m := range sagaLink.FindAllStringSubmatch(p.body, -1) {
			if seen[m[1]] {
				t.Fatalf("saga %s on two pages", m[1])
			}
			seen[m[1]] = true
			if n, _ := strconv.Atoi(m[1][2:]); n%2 != 0 {
				t.Fatalf("saga %s is not stuck but was listed", m[1])
			}
		}
		next = ""
		if m := nextLink.FindStringSubmatch(p.body); m != nil {
			next = strings.ReplaceAll(m[1], "&amp;", "&")
		}
	}
	if len(seen) != 250 || pages != 3 {
		t.Fatalf("%d sagas on %d pages, want 250 on 3", len(seen), pages)
	}
}

var (
	sagaLink = regexpMust(`<a href="/ops/sagas/(s-\d{4})">`)
	nextLink = regexpMust(`<a id="next" href="([^"]+)">`)
)

// A console that requires a credential refuses a request without one, or with a wrong one,
// and logs the authenticated name with each action.
func TestRequireCredentials(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	h, err := console.New(console.Config{DB: db.Pool, Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := console.RequireCredentials(h, console.Credentials{User: "ops"}); err == nil {
		t.Error("a user without a password was accepted")
	}
	guarded, err := console.RequireCredentials(h, console.Credentials{User: "ops", Password: "s3cret-pw", Token: "tok-123456"})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(guarded)
	defer srv.Close()
	for _, tc := range []struct {
		name string
		set  func(*http.Request)
		code int
	}{
		{"no credential", func(*http.Request) {}, http.StatusUnauthorized},
		{"wrong password", func(r *http.Request) { r.SetBasicAuth("ops", "nope") }, http.StatusUnauthorized},
		{"wrong user", func(r *http.Request) { r.SetBasicAuth("root", "s3cret-pw") }, http.StatusUnauthorized},
		{"wrong token", func(r *http.Request) { r.Header.Set("Authorization", "Bearer nope") }, http.StatusUnauthorized},
		{"basic", func(r *http.Request) { r.SetBasicAuth("ops", "s3cret-pw") }, http.StatusOK},
		{"bearer", func(r *http.Request) { r.Header.Set("Authorization", "Bearer tok-123456") }, http.StatusOK},
		{"token as a browser's password", func(r *http.Request) { r.SetBasicAuth("carol", "tok-123456") }, http.StatusOK},
	} {
		req, _ := http.NewRequest(http.MethodGet, srv.URL+"/", nil)
		tc.set(req)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		p := read(t, resp)
		if p.status != tc.code {
			t.Errorf("%s: status %d, want %d", tc.name, p.status, tc.code)
		}
		if tc.code == http.StatusUnauthorized && (p.header.Get("WWW-Authenticate") == "" || strings.Contains(p.body, "Overview")) {
			t.Errorf("%s: a refusal without a challenge, or with the page", tc.name)
		}
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	_, err := console.New(console.Config{Schema: "bad schema!", Prefix: "ops"})
	for _, want := range []string{"DB is nil", "schema", `Prefix "ops"`} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("New with a bad config: %v, want it to mention %q", err, want)
		}
	}
}

func regexpMust(s string) *regexp.Regexp { return regexp.MustCompile(s) }

// Given the service's saga definitions, the console refuses to compensate a saga past its
// pivot up front, with the reason, and files nothing.
func TestCompensatePastPivotRefused(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	s := seed(t, db)
	build := func(struct{}) (any, error) { return struct{}{}, nil }
	def := saga.MustDefine("checkout", 1, []*saga.StepDef[struct{}]{
		saga.Step[struct{}]("reserve").Send("reserve", build).Compensate("release", build),
		saga.Step[struct{}]("charge").Send("charge", build).Pivot(),
	})
	h, err := console.New(console.Config{DB: db.Pool, Schema: db.Schema, Actions: true, Prefix: "/ops", Sagas: []saga.Known{def},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	b := newBrowser(t, srv)
	p := b.get("/ops/sagas/"+s.running).expect(t, "saga page", http.StatusOK, `id="past-pivot"`)
	if strings.Contains(p.body, `id="compensate"`) {
		t.Error("the compensate button is offered past the pivot")
	}
	b.get("/ops/sagas/"+s.running+"/compensate").expect(t, "confirmation", http.StatusOK, `id="refusal"`, "past its pivot")
	before := snapshot(t, db)
	// A POST anyway (a stale page, a script): refused by saga.Admin.CompensateTx itself.
	b.post("/ops/sagas/"+s.running+"/compensate", url.Values{"csrf": {regexpCookie(t, b, srv)}}).
		expect(t, "POST compensate past the pivot", http.StatusBadRequest, "on or after its pivot &#34;charge&#34;", "can only go forward")
	if after := snapshot(t, db); after != before {
		t.Errorf("a refused compensation changed the database:\nbefore %s\nafter  %s", before, after)
	}
}

// Bulk actions over the filtered saga list show the dry run first (count and ids), refuse an
// empty filter, then file one request per saga and report the ones refused.
func TestBulkActions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	s := seed(t, db)
	srv, logs := newServer(t, db, true)
	b := newBrowser(t, srv)
	b.get("/ops/sagas?state=stuck").expect(t, "stuck sagas", http.StatusOK, `id="bulk-retry" href="/ops/bulk/sagas/retry?state=stuck"`)
	b.get("/ops/sagas").expect(t, "all sagas", http.StatusOK)
	if p := b.get("/ops/sagas"); strings.Contains(p.body, "bulk-retry") {
		t.Error("bulk actions offered without a filter")
	}
	b.get("/ops/bulk/sagas/retry").expect(t, "bulk without a filter", http.StatusBadRequest, "needs a filter")
	b.get("/ops/bulk/sagas/retry?state=nope").expect(t, "bulk with a bad state", http.StatusBadRequest, "is not a saga state")
	conf := b.get("/ops/bulk/sagas/retry?state=stuck").expect(t, "bulk dry run", http.StatusOK, `Dry run: <b>2</b> match`, s.stuck, "order-")
	before := snapshot(t, db)
	b.post("/ops/bulk/sagas/retry", url.Values{"csrf": {conf.csrf(t)}}).expect(t, "bulk POST without a filter", http.StatusBadRequest, "needs a filter")
	if after := snapshot(t, db); after != before {
		t.Fatalf("a refused bulk action changed the database")
	}
	b.post("/ops/bulk/sagas/retry", url.Values{"csrf": {conf.csrf(t)}, "state": {"stuck"}}).expect(t, "bulk POST without the ids shown", http.StatusBadRequest, "names 0 sagas")
	// An id that was never listed under this filter is skipped with the reason, not acted on.
	b.post("/ops/bulk/sagas/retry", url.Values{"csrf": {conf.csrf(t)}, "state": {"stuck"}, "saga": {s.running}}).
		expect(t, "bulk retry of a saga the filter does not match", http.StatusOK, "requested for 0 of the 1 sagas shown, 1 skipped", s.running+": is running now, not stuck")
	if after := snapshot(t, db); after != before {
		t.Fatalf("a skipped bulk action changed the database")
	}
	b.post("/ops/bulk/sagas/retry", url.Values{"csrf": {conf.csrf(t)}, "state": {"stuck"}, "saga": postedIDs(conf)}).
		expect(t, "bulk retry", http.StatusOK, `id="bulk-result">Retry: requested for 2 of the 2 sagas shown, 0 skipped`)
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Table("saga_timer")+` WHERE kind = 'operator' AND action = 'retry'`).Scan(&n); err != nil || n != 2 {
		t.Fatalf("%d retry requests filed (%v), want 2", n, err)
	}
	// Compensate every checkout saga: only the running one applies; the others are refused,
	// each with its reason.
	comp := b.get("/ops/bulk/sagas/compensate?name=checkout").expect(t, "bulk compensate dry run", http.StatusOK, `Dry run: <b>6</b> match`)
	b.post("/ops/bulk/sagas/compensate", url.Values{"csrf": {comp.csrf(t)}, "name": {"checkout"}, "saga": postedIDs(comp)}).
		expect(t, "bulk compensate", http.StatusOK, "Compensate: requested for 1 of the 6 sagas shown, 5 skipped", s.completed+": is completed; only a running saga can be compensated")
	if !strings.Contains(logs.String(), `action="saga bulk retry"`) || !strings.Contains(logs.String(), "requested=2") {
		t.Errorf("action log:\n%s", logs.String())
	}
}

// Poison rows are deleted by filter (a consumer, and text of the error) after a dry-run count;
// rows outside the filter stay, and a filter without a consumer is refused.
func TestDeletePoisonByFilter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	seed(t, db)
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("inbox_poison")+` (consumer, message_uuid, payload, attempts, error)
		VALUES ('projection', 'a', 'x', 5, 'read TIMEOUT'), ('projection', 'b', 'x', 5, 'timeout again'), ('billing', 'c', 'x', 5, 'timeout')`); err != nil {
		t.Fatal(err)
	}
	srv, logs := newServer(t, db, true)
	b := newBrowser(t, srv)
	b.get("/ops/inbox?consumer=projection").expect(t, "poison of a consumer", http.StatusOK, `id="delete-filter" href="/ops/inbox/delete?consumer=projection"`)
	b.get("/ops/inbox/delete").expect(t, "bulk delete without a consumer", http.StatusBadRequest, "choose the consumer")
	conf := b.get("/ops/inbox/delete?consumer=projection&error=timeout").expect(t, "dry run", http.StatusOK, "Dry run: <b>2</b> match")
	b.post("/ops/inbox/delete", url.Values{"csrf": {conf.csrf(t)}, "consumer": {"projection"}, "error": {"timeout"}}).expect(t, "bulk delete", http.StatusSeeOther)
	var left string
	if err := db.Pool.QueryRow(ctx, `SELECT string_agg(consumer || ':' || error, ',' ORDER BY id) FROM `+db.Table("inbox_poison")).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if strings.Count(left, ",") != 1 || strings.Contains(left, "projection:read") || !strings.Contains(left, "billing:timeout") {
		t.Errorf("rows left after the bulk delete: %s", left)
	}
	b.post("/ops/inbox/delete", url.Values{"csrf": {conf.csrf(t)}, "consumer": {"projection"}, "error": {"timeout"}}).expect(t, "second bulk delete", http.StatusBadRequest, "nothing was deleted")
	if !strings.Contains(logs.String(), "deleted=2") {
		t.Errorf("action log:\n%s", logs.String())
	}
}

// Replay from the console: a poison row's page has the button, its confirmation the dry run,
// the POST needs the CSRF token, files the request (state replay_requested, by the console's
// user) and is logged; a second one is refused, and so is a saga reply's row, with the way
// out; replay by filter shows the dry-run count first and needs a consumer.
func TestReplayPoisonFromConsole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	s := seed(t, db)
	var refusedID int64
	if err := db.Pool.QueryRow(ctx, `INSERT INTO `+db.Table("inbox_poison")+` (consumer, dedup_key, message_uuid, payload, attempts, error, replay_refusal)
		VALUES ('orchestrator', 'saga:k', 'r-1', 'x', 5, 'boom', 'a saga reply: resume the saga with `+"`onceflow saga retry s-9`"+`') RETURNING id`).Scan(&refusedID); err != nil {
		t.Fatal(err)
	}
	srv, logs := newServer(t, db, true)
	b := newBrowser(t, srv)
	id := strconv.FormatInt(s.poisonID, 10)
	b.get("/ops/inbox/"+id).expect(t, "poison page", http.StatusOK, `id="replay" href="/ops/inbox/`+id+`/replay"`, `id="state">poison`)
	conf := b.get("/ops/inbox/"+id+"/replay").expect(t, "replay confirmation", http.StatusOK, "Replay re-drives the message through its own consumer",
		"Dry run: <b>1</b> match", `action="/ops/inbox/`+id+`/replay"`)
	b.post("/ops/inbox/"+id+"/replay", url.Values{}).expect(t, "POST without the CSRF token", http.StatusForbidden, "CSRF token")
	var state string
	if err := db.Pool.QueryRow(ctx, `SELECT state FROM `+db.Table("inbox_poison")+` WHERE id = $1`, s.poisonID).Scan(&state); err != nil || state != "poison" {
		t.Fatalf("state after a refused POST: %q %v", state, err)
	}
	p := b.post("/ops/inbox/"+id+"/replay", url.Values{"csrf": {conf.csrf(t)}})
	if p.status != http.StatusSeeOther || !strings.Contains(p.header.Get("Location"), "replayed=1") {
		t.Fatalf("POST replay: %d %s\n%s", p.status, p.header.Get("Location"), p.body)
	}
	b.get(p.header.Get("Location")).expect(t, "after the request", http.StatusOK, "Replay requested", `id="state">replay_requested`, "Replay history", "console:alice")
	var by string
	if err := db.Pool.QueryRow(ctx, `SELECT state, replay_requested_by FROM `+db.Table("inbox_poison")+` WHERE id = $1`, s.poisonID).Scan(&state, &by); err != nil ||
		state != "replay_requested" || by != "console:alice" {
		t.Fatalf("after the replay request: state %q by %q (%v)", state, by, err)
	}
	b.post("/ops/inbox/"+id+"/replay", url.Values{"csrf": {conf.csrf(t)}}).expect(t, "second replay", http.StatusBadRequest, "requested already")
	if l := logs.String(); !strings.Contains(l, `user=alice action="inbox poison replay"`) || !strings.Contains(l, "poison_id="+id) {
		t.Errorf("action log:\n%s", l)
	}

	rid := strconv.FormatInt(refusedID, 10)
	page := b.get("/ops/inbox/"+rid).expect(t, "a saga reply's page", http.StatusOK, "Replay refused", "onceflow saga retry s-9")
	if strings.Contains(page.body, `id="replay"`) {
		t.Error("a refused row shows the replay button")
	}
	rc := b.get("/ops/inbox/"+rid+"/replay").expect(t, "a saga reply's confirmation", http.StatusOK, `id="refusal"`, "onceflow saga retry s-9")
	if strings.Contains(rc.body, `id="confirm"`) {
		t.Error("a refused row's confirmation has a button")
	}
	b.post("/ops/inbox/"+rid+"/replay", url.Values{"csrf": {conf.csrf(t)}}).expect(t, "POST replay of a saga reply", http.StatusBadRequest, "onceflow saga retry s-9")

	b.get("/ops/inbox/replay").expect(t, "bulk replay without a consumer", http.StatusBadRequest, "choose the consumer")
	b.get("/ops/inbox/replay?consumer=projection").expect(t, "bulk replay of requested rows", http.StatusOK, `id="refusal"`, "no poison row matches")
	b.get("/ops/inbox/replay?consumer=orchestrator").expect(t, "bulk replay of saga rows", http.StatusOK, `id="refusal"`, "onceflow saga retry s-9")
	b.get("/ops/inbox/0/replay").expect(t, "a bad id", http.StatusBadRequest, "not a poison row id")
	b.get("/ops/inbox?consumer=orchestrator").expect(t, "inbox page", http.StatusOK, `id="replay-filter" href="/ops/inbox/replay?consumer=orchestrator"`)
}

var postedID = regexp.MustCompile(`<input type="hidden" name="saga" value="([^"]*)">`)

// postedIDs are the saga ids a confirmation form posts (unescaped).
func postedIDs(p page) []string {
	var ids []string
	for _, m := range postedID.FindAllStringSubmatch(p.body, -1) {
		ids = append(ids, html.UnescapeString(m[1]))
	}
	return ids
}

// Overdue scheduled messages (no relay moves them) show on the overview as a figure and a
// problem, and on the outbox page as late; a long listing pages on by its cursor.
func TestScheduledOverdue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("outbox_scheduled")+` (event_id, topic, key_hash, payload, due_at)
		SELECT gen_random_uuid(), 'reminders', g, 'x', now() - interval '10 minutes' + (g + 30) * interval '1 second' FROM generate_series(1, 60) g`); err != nil {
		t.Fatal(err)
	}
	srv, _ := newServer(t, db, false)
	b := newBrowser(t, srv)
	b.get("/ops/").expect(t, "overview", http.StatusOK, `id="verdict" class="stuck"`, `id="scheduled-overdue">60</b> overdue scheduled messages`,
		"60 scheduled messages are overdue")
	p := b.get("/ops/outbox").expect(t, "outbox", http.StatusOK, `id="scheduled-rows">60</b> scheduled`, `<span class="bad">60</span>`, "the most by 9m", " late</span>")
	next := regexp.MustCompile(`id="scheduled-next" href="([^"]+)"`).FindStringSubmatch(p.body)
	if next == nil || strings.Count(p.body, "<td>reminders</td>") != 50 {
		t.Fatalf("first page of 60: %d rows, next link %v", strings.Count(p.body, "<td>reminders</td>"), next)
	}
	p = b.get(strings.TrimPrefix(html.UnescapeString(next[1]), srv.URL)).expect(t, "second page", http.StatusOK)
	if n := strings.Count(p.body, "<td>reminders</td>"); n != 10 || strings.Contains(p.body, `id="scheduled-next"`) {
		t.Errorf("second page: %d rows", n)
	}
}

// The retry lane on the inbox page: per consumer the parked messages, keys, longest wait (its
// key) and next due; the rows key by key (head, then the rows behind), a page at a time, with
// the consumer filter; the overview counts them and says what is stuck. With actions on, a
// head is retried now (a row behind has no button, and its release is refused), and every
// head of a consumer; both are in the audit trail.
func TestRetryLane(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	var head, behind int64
	if err := db.Pool.QueryRow(ctx, `INSERT INTO `+db.Table("inbox_parked")+` (consumer, topic, lane, dedup_key, message_uuid, source, payload, attempts, error, due_at, parked_at)
		VALUES ('billing', 'orders', 'o-1', 'k-1', 'm-head', 'orders/3@10', 'x', 2, $1, now() + interval '10 minutes', now() - interval '2 hours') RETURNING id`,
		"provider down: "+evilText).Scan(&head); err != nil {
		t.Fatal(err)
	}
	if err := db.Pool.QueryRow(ctx, `INSERT INTO `+db.Table("inbox_parked")+` (consumer, topic, lane, dedup_key, message_uuid, source, payload, parked_at)
		VALUES ('billing', 'orders', 'o-1', 'k-2', 'm-behind', 'orders/3@11', 'x', now() - interval '1 hour') RETURNING id`).Scan(&behind); err != nil {
		t.Fatal(err)
	}
	// 60 more keys of consumer mailer, one message each, due from 10 minutes ago on, a minute apart:
	// 49 of them due later.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("inbox_parked")+` (consumer, topic, lane, dedup_key, message_uuid, payload, attempts, error, due_at, parked_at)
		SELECT 'mailer', 'emails', 'u-' || lpad(g::text, 2, '0'), 'k-m' || g, 'm-' || g, 'x', 1, 'smtp 421', now() - interval '10 minutes' + g * interval '1 minute', now() - interval '20 minutes'
		FROM generate_series(0, 59) g`); err != nil {
		t.Fatal(err)
	}
	srv, _ := newServer(t, db, false)
	b := newBrowser(t, srv)
	b.get("/ops/").expect(t, "overview", http.StatusOK, `id="lane-parked">62</b> in the retry lane`,
		`key &#34;o-1&#34; (topic orders) of inbox consumer &#34;billing&#34; has waited 2h`, `retry lane was due 10m`)
	p := b.get("/ops/inbox").expect(t, "inbox page", http.StatusOK, `id="retry-lane"`, `id="lane-summary"`,
		"<td>2</td><td>1</td><td>2h0m</td>", "orders <b>o-1</b>", "<td>60</td><td>60</td>",
		`<span class="bad">overdue 10m`, "in 10m", "waits behind its head", "provider down: &lt;script&gt;", `id="lane-next"`)
	if strings.Contains(p.body, "retry now…") || strings.Contains(p.body, "<script>") {
		t.Error("a read-only console offers retry now, or shows markup unescaped")
	}
	if n := strings.Count(p.body, "<td>head</td>") + strings.Count(p.body, "<td>behind</td>"); n != 50 {
		t.Errorf("first page: %d rows, want 50", n)
	}
	next := regexp.MustCompile(`id="lane-next" href="([^"]+)"`).FindStringSubmatch(p.body)
	p = b.get(strings.TrimPrefix(html.UnescapeString(next[1]), srv.URL)).expect(t, "second page", http.StatusOK)
	if n := strings.Count(p.body, "<td>head</td>"); n != 12 || strings.Contains(p.body, `id="lane-next"`) {
		t.Errorf("second page: %d heads", n)
	}
	p = b.get("/ops/inbox?consumer=billing").expect(t, "billing's lane", http.StatusOK, "m-head", "m-behind")
	if strings.Contains(p.body, "smtp 421") || strings.Index(p.body, "m-head") > strings.Index(p.body, "m-behind") {
		t.Error("the consumer filter shows another consumer's rows, or the head after the row behind it")
	}
	b.get("/ops/inbox?parked_after=nonsense").expect(t, "a bad cursor", http.StatusBadRequest, "parked_after")
	hid, bid := strconv.FormatInt(head, 10), strconv.FormatInt(behind, 10)
	b.get("/ops/inbox/parked/"+hid+"/release").expect(t, "read-only confirmation", http.StatusOK, "Retry now makes the message due at once", "read-only")

	srv, logs := newServer(t, db, true)
	b = newBrowser(t, srv)
	p = b.get("/ops/inbox?consumer=billing").expect(t, "billing's lane with actions", http.StatusOK,
		`href="/ops/inbox/parked/`+hid+`/release?consumer=billing">retry now…`, `href="/ops/inbox/parked/release?consumer=billing">retry all now…`)
	if strings.Contains(p.body, "/inbox/parked/"+bid+"/release") {
		t.Error("a row behind its head has a retry now button")
	}
	conf := b.get("/ops/inbox/parked/"+hid+"/release?consumer=billing").expect(t, "release confirmation", http.StatusOK, "Dry run: <b>1</b> match",
		`action="/ops/inbox/parked/`+hid+`/release"`)
	rc := b.get("/ops/inbox/parked/"+bid+"/release").expect(t, "release of a row behind", http.StatusOK, `id="refusal"`, "waits behind row "+hid)
	if strings.Contains(rc.body, `id="confirm"`) {
		t.Error("a refused release has a button")
	}
	b.post("/ops/inbox/parked/"+bid+"/release", url.Values{"csrf": {conf.csrf(t)}}).expect(t, "POST release of a row behind", http.StatusBadRequest, "waits behind row "+hid)
	var due bool
	if err := db.Pool.QueryRow(ctx, `SELECT due_at <= now() FROM `+db.Table("inbox_parked")+` WHERE id = $1`, head).Scan(&due); err != nil || due {
		t.Fatalf("the dry run released the head: %v %v", due, err)
	}
	b.post("/ops/inbox/parked/"+hid+"/release", url.Values{}).expect(t, "POST without the CSRF token", http.StatusForbidden, "CSRF token")
	res := b.post("/ops/inbox/parked/"+hid+"/release", url.Values{"csrf": {conf.csrf(t)}, "consumer": {"billing"}})
	if res.status != http.StatusSeeOther || !strings.Contains(res.header.Get("Location"), "released=1") {
		t.Fatalf("POST release: %d %s\n%s", res.status, res.header.Get("Location"), res.body)
	}
	b.get(res.header.Get("Location")).expect(t, "after the release", http.StatusOK, `id="released">1 parked messages made due now`)
	if err := db.Pool.QueryRow(ctx, `SELECT due_at <= now() FROM `+db.Table("inbox_parked")+` WHERE id = $1`, head).Scan(&due); err != nil || !due {
		t.Fatalf("the head is not due after the release: %v %v", due, err)
	}
	b.get("/ops/inbox/parked/"+hid+"/release").expect(t, "a due head's confirmation", http.StatusOK, `id="refusal"`, "due already")

	b.get("/ops/inbox/parked/release").expect(t, "bulk release without a consumer", http.StatusBadRequest, "choose the consumer")
	bc := b.get("/ops/inbox/parked/release?consumer=mailer").expect(t, "bulk release confirmation", http.StatusOK, "Dry run: <b>49</b> match")
	res = b.post("/ops/inbox/parked/release", url.Values{"csrf": {bc.csrf(t)}, "consumer": {"mailer"}})
	if res.status != http.StatusSeeOther || !strings.Contains(res.header.Get("Location"), "released=49") {
		t.Fatalf("POST bulk release: %d %s\n%s", res.status, res.header.Get("Location"), res.body)
	}
	b.get("/ops/inbox/parked/release?consumer=mailer").expect(t, "bulk release again", http.StatusOK, `id="refusal"`, "no parked message waiting for a later time")
	b.get("/ops/audit").expect(t, "audit trail", http.StatusOK, "inbox release", "consumer=mailer", "retry-lane heads made due now: 49", "<td>"+hid+"</td>")
	if l := logs.String(); !strings.Contains(l, `action="inbox parked release"`) || !strings.Contains(l, "parked_id="+hid) {
		t.Errorf("action log:\n%s", l)
	}
}
