package browsertest

import (
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/onceflow/onceflow/console"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/saga"
)

// rebindPage is the page of another site that, once its owner has pointed the site's name at
// the console's address (DNS rebinding), reads the console as its own origin: it fetches a
// saga's retry confirmation for the CSRF token, sets the double-submit cookie on its own name
// (a token it read, or one it made up), and posts the retry with a matching Origin. Against
// a console that answers any Host every one of those checks passes. It reports what it got
// in #result.
const rebindPage = `<!doctype html><title>cheap flights</title><pre id="result"></pre><script>
(async () => {
  const id = new URLSearchParams(location.search).get("saga");
  const path = "/ops/sagas/" + encodeURIComponent(id) + "/retry";
  const out = {};
  try {
    const conf = await fetch(path);
    out.get = conf.status;
    const m = (await conf.text()).match(/name="csrf" value="([0-9a-f]{64})"/);
    out.token = !!m;
    const tok = m ? m[1] : "ab".repeat(32);
    if (!m) document.cookie = "onceflow_csrf=" + tok + "; path=/ops";
    const post = await fetch(path, {method: "POST", body: new URLSearchParams({csrf: tok})});
    out.post = post.status;
    if (post.status !== 200) out.body = (await post.text()).slice(0, 300);
  } catch (e) { out.error = String(e); }
  document.getElementById("result").textContent = JSON.stringify(out);
})();
</script>`

// rebindResult is what rebindPage reports.
type rebindResult struct {
	Get   int    `json:"get"`   // the status of the confirmation page
	Token bool   `json:"token"` // whether it read the CSRF token
	Post  int    `json:"post"`  // the status of the retry's POST (after its redirect)
	Error string `json:"error"` // a network error
	Body  string `json:"body"`  // the start of a refused POST's page
}

// withRebindPage mounts the console under /ops/, as a service does, and serves /rebind for
// the foreign host: that one page comes from the attacker's server, which answered the name
// before it was rebound; every other request for the name now reaches the console's
// listener, at the same origin.
func withRebindPage(h http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/ops/", h)
	mux.HandleFunc("GET /rebind", func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasPrefix(r.Host, foreignHost+":") {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		_, _ = w.Write([]byte(rebindPage))
	})
	return mux
}

// rebind loads rebindPage from the foreign host at srv's port, against saga id, and returns
// what it reports.
func (b *tab) rebind(srv *httptest.Server, id string) rebindResult {
	b.t.Helper()
	port := srv.URL[strings.LastIndex(srv.URL, ":")+1:]
	if code := b.open("http://" + foreignHost + ":" + port + "/rebind?saga=" + id); code != http.StatusOK {
		b.fail("the rebinding page: status %d", code)
	}
	raw, err := chromedp.Run(b.ctx, chromedp.Poll[string](`document.getElementById("result").textContent`, chromedp.WithPollingTimeout(20*time.Second)))
	if err != nil {
		b.fail("the rebinding page reported nothing: %v", err)
	}
	var res rebindResult
	if err := json.Unmarshal([]byte(raw), &res); err != nil {
		b.fail("the rebinding page's report %q: %v", raw, err)
	}
	return res
}

// DNS rebinding in a browser: a console on loopback without a credential, serving the hosts
// of `onceflow ui --addr 127.0.0.1:PORT` (127.0.0.1 and localhost). A page of another site,
// whose name resolves to 127.0.0.1, gets 421 for every request to the console, reads no
// token and files nothing; the console's own page, under an allowed name, retries the saga.
// The same page against a console that answers every host does file the retry: the refusal
// is the host rule's doing, not the CSRF check's.
func TestBrowserHostRule(t *testing.T) {
	t.Parallel()
	b := newTab(t)
	db := testdb.New(t)
	s := seed(t, db)
	at := seedTime()
	other := "order-stuck-2"
	insertSaga(t, db, sagaRow{id: other, state: "stuck", err: "stock service unavailable", steps: []saga.StepHistory{step(at, "reserve", "compensating")}, createdAt: at})
	logs := &syncBuffer{}
	serve := func(hosts []string) *httptest.Server {
		h, err := console.New(console.Config{DB: db.Pool, Schema: db.Schema, Actions: true, Prefix: "/ops", Hosts: hosts,
			Logger: slog.New(slog.NewTextHandler(logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(withRebindPage(h))
		t.Cleanup(srv.Close)
		return srv
	}
	srv := serve([]string{"127.0.0.1", "localhost"})
	port := srv.URL[strings.LastIndex(srv.URL, ":")+1:]

	if got := b.rebind(srv, s.stuck); got.Get != http.StatusMisdirectedRequest || got.Token || got.Post != http.StatusMisdirectedRequest || got.Error != "" {
		b.fail("the rebinding page against the console: %+v, want 421 for both requests and no token", got)
	}
	if got := operatorRequests(t, db, "retry"); len(got) != 0 {
		t.Fatalf("the rebinding page filed retries: %q", got)
	}
	if l := logs.String(); !strings.Contains(l, "host="+foreignHost+":"+port) || !strings.Contains(l, "does not serve") {
		t.Errorf("no log line for the refused host:\n%s", l)
	}
	// What a user who opens the console under that name sees.
	if code := b.open("http://" + foreignHost + ":" + port + "/ops/"); code != http.StatusMisdirectedRequest {
		b.fail("the overview under %s: status %d, want 421", foreignHost, code)
	}
	if txt := b.expectText("the overview under a foreign host", "421 misdirected request", strconv.Quote(foreignHost+":"+port), "onceflow ui --host"); strings.Contains(txt, "STUCK") {
		b.fail("the refusal shows the overview")
	}
	b.screenshot("host-refused.png")

	// Under a name it serves, the console's own page acts.
	if code := b.open("http://localhost:" + port + "/ops/sagas/" + s.stuck); code != http.StatusOK {
		b.fail("the saga page under localhost: status %d", code)
	}
	b.click("#retry", "/ops/sagas/"+s.stuck+"/retry")
	b.click("#confirm", "requested=retry")
	b.expectText("after the retry under localhost", "Retry requested")
	if got := operatorRequests(t, db, "retry"); !slices.Equal(got, []string{s.stuck}) {
		t.Fatalf("retry requests after the retry under localhost: %q, want [%s]", got, s.stuck)
	}

	// The control: a console that answers every host (Config.Hosts empty, safe only behind
	// a credential) is the rebinding page's to drive.
	open := serve(nil)
	if got := b.rebind(open, other); got.Get != http.StatusOK || !got.Token || got.Post != http.StatusOK || got.Error != "" {
		b.fail("the rebinding page against a console without Hosts: %+v, want it to read the token and file the retry", got)
	}
	if got := operatorRequests(t, db, "retry"); !slices.Equal(got, []string{s.stuck, other}) {
		t.Fatalf("retry requests after the control: %q, want [%s %s]", got, s.stuck, other)
	}
}
