package console

import (
	"bytes"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// csrfCookie holds the double-submit token: every form carries the same value in a hidden
// field, which another site can neither read nor set (SameSite=Strict, HttpOnly).
const csrfCookie = "onceflow_csrf"

// pageNames are the templates in templates/, each rendered inside layout.html.
var pageNames = []string{"error", "overview", "sagas", "saga", "confirm", "bulk", "outbox", "find", "parked", "inbox", "poison", "idempotency", "versions", "upgrade", "audit"}

func (c *Console) parseTemplates() error {
	funcs := template.FuncMap{
		"ago":       ago,
		"dur":       func(secs float64) string { return fmtDur(time.Duration(secs * float64(time.Second))) },
		"ts":        fmtTime,
		"tsp":       func(t *time.Time) string { return fmtTimePtr(t) },
		"pretty":    prettyJSON,
		"short":     shorten,
		"path":      c.link,
		"query":     func(path string, kv ...string) string { return c.link(path) + query(kv...) },
		"pathEsc":   url.PathEscape,
		"add":       func(a, b int) int { return a + b },
		"int":       func(n int64) int { return int(n) },
		"bytesText": bytesText,
	}
	for _, name := range pageNames {
		t, err := template.New("layout.html").Funcs(funcs).ParseFS(templateFS, "templates/layout.html", "templates/auditrows.html", "templates/"+name+".html")
		if err != nil {
			return fmt.Errorf("console: template %s: %w", name, err)
		}
		c.pages[name] = t
	}
	return nil
}

// view is what layout.html renders; P is the page's own data.
type view struct {
	Prefix  string
	Title   string
	Nav     string
	Actions bool
	CSRF    string
	Refresh int // seconds; 0: no self-refresh
	Schema  string
	P       any
}

// render writes a page. The whole page is rendered into a buffer first, so a template error
// becomes a 500 instead of half a page after a 200.
func (c *Console) render(w http.ResponseWriter, r *http.Request, status int, name string, p any) {
	v := view{Prefix: c.cfg.Prefix, Nav: name, Actions: c.actionsFor(r), CSRF: c.csrfToken(w, r), Schema: c.cfg.Schema, P: p}
	if name == "overview" && c.cfg.Refresh > 0 {
		v.Refresh = int(c.cfg.Refresh.Round(time.Second) / time.Second)
	}
	var buf bytes.Buffer
	if err := c.pages[name].Execute(&buf, v); err != nil {
		c.cfg.Logger.Error("console: render page", "page", name, "err", err)
		http.Error(w, "the page could not be rendered; the service's log has the error", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

// csrfToken returns the request's CSRF token, setting the cookie when it has none yet.
func (c *Console) csrfToken(w http.ResponseWriter, r *http.Request) string {
	if ck, err := r.Cookie(csrfCookie); err == nil && validToken(ck.Value) {
		return ck.Value
	}
	b := make([]byte, 32)
	_, _ = rand.Read(b) // never fails (crypto/rand)
	tok := hex.EncodeToString(b)
	p := c.cfg.Prefix
	if p == "" {
		p = "/"
	}
	http.SetCookie(w, &http.Cookie{Name: csrfCookie, Value: tok, Path: p, HttpOnly: true, Secure: r.TLS != nil, SameSite: http.SameSiteStrictMode})
	return tok
}

func validToken(s string) bool {
	if len(s) != 64 {
		return false
	}
	_, err := hex.DecodeString(s)
	return err == nil
}

// checkPost refuses a POST unless actions are on, its form's CSRF token equals the cookie's
// and it comes from this host; the refusal is a pageError.
func (c *Console) checkPost(w http.ResponseWriter, r *http.Request) error {
	if !c.cfg.Actions {
		return pageErr(http.StatusForbidden, "This console is read-only: actions are switched off (console.Config.Actions, `onceflow ui --actions`).")
	}
	if roleOf(r) == Viewer {
		return pageErr(http.StatusForbidden, "Refused: your credential is a viewer's, which reads and changes nothing; an operator's credential acts.")
	}
	r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
	if err := r.ParseForm(); err != nil {
		return pageErr(http.StatusBadRequest, "The form could not be read.")
	}
	ck, err := r.Cookie(csrfCookie)
	form := r.PostForm.Get("csrf")
	if err != nil || !validToken(ck.Value) || subtle.ConstantTimeCompare([]byte(ck.Value), []byte(form)) != 1 {
		return pageErr(http.StatusForbidden, "Refused: the form's CSRF token is missing or does not match. Reload the page and submit it again.")
	}
	// A browser sends Origin with every POST. Missing (not a browser, or one that hides it)
	// or "null" (a sandboxed frame, a data: URL, a redirect across sites) says nothing about
	// where the form came from: refused, so the double-submit cookie is bound to this site.
	o := r.Header.Get("Origin")
	if u, err := url.Parse(o); o == "" || o == "null" || err != nil || !strings.EqualFold(u.Host, r.Host) {
		what := "from another site"
		if o == "" || o == "null" {
			what = "without its origin (Origin: " + strconv.Quote(o) + "); post it from the console's own page"
		}
		return pageErr(http.StatusForbidden, "Refused: the form was posted "+what+".")
	}
	return nil
}

// link is path under the console's prefix.
func (c *Console) link(path string) string { return c.cfg.Prefix + path }

// query encodes key/value pairs, leaving out empty values: "?a=1&b=2", or "".
func query(kv ...string) string {
	v := url.Values{}
	for i := 0; i+1 < len(kv); i += 2 {
		if kv[i+1] != "" {
			v.Set(kv[i], kv[i+1])
		}
	}
	if len(v) == 0 {
		return ""
	}
	return "?" + v.Encode()
}

func fmtDur(d time.Duration) string {
	switch {
	case d < 0:
		return "-" + fmtDur(-d)
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Hour:
		return d.Round(time.Second).String()
	case d < 48*time.Hour:
		return strings.TrimSuffix(d.Round(time.Minute).String(), "0s") // 1h5m, not 1h5m0s
	}
	return fmt.Sprintf("%dd%dh", d/(24*time.Hour), (d%(24*time.Hour))/time.Hour)
}

// ago is the time from t to now, on the local clock (pages that compare with the database's
// clock pass their own).
func ago(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return fmtDur(time.Since(t))
}

func fmtTime(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

func fmtTimePtr(t *time.Time) string {
	if t == nil {
		return "-"
	}
	return fmtTime(*t)
}

// prettyJSON indents a JSON document for a <pre>; anything else is shown as it is.
func prettyJSON(b []byte) string {
	var out bytes.Buffer
	if json.Indent(&out, b, "", "  ") != nil {
		return bytesText(b)
	}
	return out.String()
}

// bytesText is b as text when it is UTF-8, else a note with its size (binary payloads are
// not dumped into a page).
func bytesText(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	return fmt.Sprintf("(%d bytes of binary data)", len(b))
}

// shorten puts s on one line and cuts it to n bytes at a rune boundary.
func shorten(n int, s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "…"
}

// actionsFor reports whether r's user may act: actions are on and the user is not a Viewer.
func (c *Console) actionsFor(r *http.Request) bool {
	return c.cfg.Actions && roleOf(r) != Viewer
}
