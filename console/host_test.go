package console_test

import (
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/console"
	"github.com/onceflow/onceflow/internal/testdb"
)

// DNS rebinding: a page of another site whose name resolves to the console's address sends
// its own name as Host. The console answers only the hosts it serves, GET and POST alike, so
// the page reads no CSRF token and no data, and its posts change nothing.
func TestHostRule(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	s := seed(t, db)
	logs := &logBuffer{}
	h, err := console.New(console.Config{DB: db.Pool, Schema: db.Schema, Actions: true, Prefix: "/ops",
		Hosts: []string{"127.0.0.1", "LocalHost"}, Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	port := srv.URL[strings.LastIndex(srv.URL, ":")+1:]
	do := func(method, host, path, origin string, form url.Values) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(form.Encode()))
		req.Host = host
		if origin != "" {
			req.Header.Set("Origin", origin)
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	before := snapshot(t, db)
	evil := "rebind.attacker.example:" + port
	for _, path := range []string{"/ops/", "/ops/sagas/" + s.stuck, "/ops/sagas/" + s.stuck + "/retry", "/ops/idempotency?owner=orders-api&key=key-1"} {
		if code, body := do(http.MethodGet, evil, path, "", nil); code != http.StatusMisdirectedRequest || strings.Contains(body, "csrf") || strings.Contains(body, s.stuck) {
			t.Errorf("GET %s for host %s: %d\n%s", path, evil, code, body)
		}
	}
	code, body := do(http.MethodPost, evil, "/ops/sagas/"+s.stuck+"/retry", "http://"+evil, url.Values{"csrf": {strings.Repeat("ab", 32)}})
	if code != http.StatusMisdirectedRequest || !strings.Contains(body, "onceflow ui --host") {
		t.Errorf("POST for host %s: %d\n%s", evil, code, body)
	}
	if after := snapshot(t, db); after != before {
		t.Fatalf("requests for another host changed the database:\nbefore %s\nafter  %s", before, after)
	}
	if l := logs.String(); !strings.Contains(l, "host=rebind.attacker.example:"+port) || !strings.Contains(l, "does not serve") {
		t.Errorf("no log line for the refused host:\n%s", l)
	}
	// The hosts it serves, at any port, in any case.
	for _, host := range []string{"127.0.0.1:" + port, "localhost:" + port, "LOCALHOST:" + port} {
		if code, body := do(http.MethodGet, host, "/ops/", "", nil); code != http.StatusOK {
			t.Errorf("GET for host %s: %d\n%s", host, code, body)
		}
	}
	if _, err := console.New(console.Config{DB: db.Pool, Hosts: []string{"http://ops.example.com/"}}); err == nil || !strings.Contains(err.Error(), "is not a host name") {
		t.Errorf("a URL as a host: %v", err)
	}
}

// A viewer's credential reads every page but sees no button and cannot post; an operator's
// acts; both are recorded under their names.
func TestViewerAndOperatorCredentials(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	s := seed(t, db)
	h, err := console.New(console.Config{DB: db.Pool, Schema: db.Schema, Actions: true, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	guarded, err := console.RequireCredentials(h, console.Credentials{User: "ops", Password: "op-s3cret"},
		console.Credentials{User: "audit", Password: "view-s3cret", Role: console.Viewer})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(guarded)
	t.Cleanup(srv.Close)
	as := func(user, pw string) *browser {
		b := newBrowser(t, srv)
		b.c.Transport = basicAuth{user, pw}
		return b
	}
	viewer, operator := as("audit", "view-s3cret"), as("ops", "op-s3cret")
	before := snapshot(t, db)
	p := viewer.get("/sagas/"+s.stuck+"/retry").expect(t, "viewer's confirmation", http.StatusOK, "read-only")
	if strings.Contains(p.body, `id="confirm"`) {
		t.Errorf("a viewer is offered the button:\n%s", p.body)
	}
	// A viewer's post, even with a token of an operator's page, is refused.
	tok := operator.get("/sagas/" + s.stuck + "/retry").csrf(t)
	viewer.post("/sagas/"+s.stuck+"/retry", url.Values{"csrf": {tok}}, "Cookie", "onceflow_csrf="+tok).expect(t, "viewer's POST", http.StatusForbidden, "viewer")
	if after := snapshot(t, db); after != before {
		t.Fatalf("a viewer's POST changed the database")
	}
	operator.post("/sagas/"+s.stuck+"/retry", url.Values{"csrf": {tok}}).expect(t, "operator's POST", http.StatusSeeOther)
	operator.get("/audit").expect(t, "audit trail", http.StatusOK, "<td>ops</td><td>saga retry</td>")
}

// basicAuth is a RoundTripper that signs every request with basic authentication.
type basicAuth struct{ user, pw string }

func (a basicAuth) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.SetBasicAuth(a.user, a.pw)
	return http.DefaultTransport.RoundTrip(r)
}

// A request outside the console's prefix (a browser's own /favicon.ico, with the console
// mounted at the root of a service) gets a 404 that sets no CSRF cookie: a new cookie on the
// prefix's path would replace the operator's token, and the confirmation open in another tab
// would be refused.
func TestOutsideThePrefixKeepsTheToken(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	srv, _ := newServer(t, db, true)
	resp, err := http.Get(srv.URL + "/favicon.ico")
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound || len(resp.Cookies()) != 0 {
		t.Fatalf("GET /favicon.ico outside /ops: %d, cookies %v", resp.StatusCode, resp.Cookies())
	}
}
