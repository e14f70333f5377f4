package browsertest

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"

	"github.com/onceflow/onceflow/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// foreignHost is a name of another site that the browser resolves to 127.0.0.1, as a page
// whose owner rebinds its DNS name to the console's address would have it.
const foreignHost = "evil.example"

// The viewport of every page, and so of the screenshots in docs/console.
const viewW, viewH = 1200, 800

// findChromium returns the browser binary. In CI (CI set) a missing browser fails the test,
// so the browser tests can never be skipped there without anyone noticing.
func findChromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{os.Getenv("ONCEFLOW_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"} {
		if name == "" {
			continue
		}
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	msg := "no chromium on PATH for the console's browser tests: install it (Debian: apt-get install -y chromium; .ci/run does) or set ONCEFLOW_CHROMIUM to the browser binary"
	if os.Getenv("CI") != "" {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return ""
}

// The tests share one Chromium (its start costs more than a test's pages), each in a
// browser context of its own: its own cookies and storage, as a separate profile has.
var browser struct {
	mu    sync.Mutex
	users int                // tests holding it; the last one to finish stops it
	ctx   context.Context    // the browser's first tab, from which the tests' tabs are made
	stop  context.CancelFunc // stops the browser and waits for it to exit
	out   *syncBuffer        // its stderr, shown when a step fails
}

// useBrowser starts the shared browser unless it runs, and returns its context.
func useBrowser(bin string) (context.Context, error) {
	browser.mu.Lock()
	defer browser.mu.Unlock()
	if browser.users == 0 {
		dir, err := os.MkdirTemp("", "onceflow-chromium-")
		if err != nil {
			return nil, err
		}
		out := &syncBuffer{}
		opts := append(chromedp.DefaultExecAllocatorOptions[:],
			chromedp.ExecPath(bin),
			chromedp.Flag("headless", "new"),
			chromedp.NoSandbox, // root in a container: Chromium's sandbox needs user namespaces
			chromedp.WindowSize(viewW, viewH),
			chromedp.UserDataDir(dir),
			chromedp.Flag("host-resolver-rules", "MAP "+foreignHost+" 127.0.0.1"),
			chromedp.CombinedOutput(out),
		)
		actx, acancel := chromedp.NewExecAllocator(context.Background(), opts...)
		bctx, bcancel := chromedp.NewContext(actx)
		stop := func() { bcancel(); acancel(); _ = os.RemoveAll(dir) } // acancel waits for the browser to exit
		// The first action starts the browser, which lives as long as bctx (not a context
		// with a deadline: that would stop it), so the wait for it is bounded here.
		started := make(chan error, 1)
		go func() { started <- chromedp.Do(bctx) }()
		select {
		case err = <-started:
		case <-time.After(time.Minute):
			err = errors.New("no answer in a minute")
		}
		if err != nil {
			stop()
			return nil, fmt.Errorf("start %s: %w\n%s", bin, err, out.String())
		}
		browser.ctx, browser.stop, browser.out = bctx, stop, out
	}
	browser.users++
	return browser.ctx, nil
}

// releaseBrowser stops the shared browser once no test uses it.
func releaseBrowser() {
	browser.mu.Lock()
	defer browser.mu.Unlock()
	if browser.users--; browser.users == 0 {
		browser.stop()
		browser.ctx, browser.stop = nil, nil
	}
}

// tab is one page of the shared headless Chromium, in a browser context of its own, closed
// when the test ends.
type tab struct {
	t      *testing.T
	ctx    context.Context
	shots  string // ONCEFLOW_SCREENSHOTS: where screenshots go; "" takes them and writes nothing
	lastOK string // the last URL reached, for failure messages
	// started is closed once the tab is open, with startErr set if it could not open: the
	// browser starts while the test sets up its database.
	started  chan struct{}
	startErr error
}

func newTab(t *testing.T) *tab {
	t.Helper()
	bin := findChromium(t)
	b := &tab{t: t, shots: os.Getenv("ONCEFLOW_SCREENSHOTS"), started: make(chan struct{})}
	var closeTab context.CancelFunc = func() {}
	go func() {
		defer close(b.started)
		bctx, err := useBrowser(bin)
		if err != nil {
			b.startErr = err
			return
		}
		ctx, cancel := context.WithTimeout(bctx, 90*time.Second)
		tctx, tcancel := chromedp.NewContext(ctx, chromedp.WithNewBrowserContext())
		closeTab = func() { tcancel(); cancel(); releaseBrowser() }
		b.ctx = tctx
		if err := chromedp.Do(tctx, chromedp.EmulateViewport(viewW, viewH)); err != nil {
			b.startErr = fmt.Errorf("open a tab: %w", err)
		}
	}()
	t.Cleanup(func() { <-b.started; closeTab() })
	return b
}

// ready waits until the browser runs; every step calls it first.
func (b *tab) ready() {
	b.t.Helper()
	<-b.started
	if b.startErr != nil {
		b.t.Fatal(b.startErr)
	}
}

// fail ends the test with what went wrong and where the page is.
func (b *tab) fail(format string, args ...any) {
	b.t.Helper()
	msg := fmt.Sprintf(format, args...)
	loc, _ := chromedp.Run(b.ctx, chromedp.Location())
	text, _ := chromedp.Run(b.ctx, chromedp.Evaluate[string](`document.body ? document.body.innerText : ""`))
	b.t.Fatalf("%s\nthe page is at %s (last reached %s):\n%s\nbrowser output:\n%s", msg, loc, b.lastOK, text, browserOutput())
}

// login makes the browser send a basic-auth credential with every request, as a user who
// typed it into the browser's prompt does.
func (b *tab) login(user, password string) {
	b.t.Helper()
	b.ready()
	auth := "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+password))
	if _, err := chromedp.Call(b.ctx, network.SetExtraHTTPHeaders, network.SetExtraHTTPHeadersParams{Headers: network.Headers{"Authorization": auth}}); err != nil {
		b.fail("set the credential: %v", err)
	}
}

// open loads url and returns the HTTP status of the document.
func (b *tab) open(url string) int64 {
	b.t.Helper()
	b.ready()
	resp, err := chromedp.Run(b.ctx, chromedp.NavigateResponse(url))
	if err != nil || resp == nil {
		b.fail("open %s: %v", url, err)
	}
	b.lastOK = resp.URL
	return resp.Status
}

// click clicks the element selector names (a CSS selector) as a user does, with the mouse,
// waits for the page it leads to, checks that the page's address contains leadsTo and
// returns the page's HTTP status (after redirects: a form's POST answered with 303 gives
// the status of the page it redirected to).
func (b *tab) click(selector, leadsTo string) int64 {
	b.t.Helper()
	b.ready()
	sel, _ := json.Marshal(selector)
	if ok, err := chromedp.Run(b.ctx, chromedp.Evaluate[bool](`document.querySelector(`+string(sel)+`) !== null`)); err != nil || !ok {
		b.fail("no %s on the page (%v)", selector, err)
	}
	resp, err := chromedp.RunResponse(b.ctx, chromedp.Click(chromedp.CSS(selector)))
	if err != nil || resp == nil {
		b.fail("click %s: %v", selector, err)
	}
	if !strings.Contains(resp.URL, leadsTo) {
		b.fail("click %s led to %s, want an address containing %q", selector, resp.URL, leadsTo)
	}
	b.lastOK = resp.URL
	return resp.Status
}

// text is the page's text as a user sees it.
func (b *tab) text() string {
	b.t.Helper()
	b.ready()
	s, err := chromedp.Run(b.ctx, chromedp.Evaluate[string](`document.body ? document.body.innerText : ""`))
	if err != nil {
		b.fail("read the page's text: %v", err)
	}
	return s
}

// expectText fails the test unless the page's text holds every one of want.
func (b *tab) expectText(what string, want ...string) string {
	b.t.Helper()
	txt := b.text()
	for _, w := range want {
		if !strings.Contains(txt, w) {
			b.fail("%s: the page lacks %q", what, w)
		}
	}
	return txt
}

// rows returns the cells' text of each row of the table selector names, header excluded.
func (b *tab) rows(selector string) [][]string {
	b.t.Helper()
	b.ready()
	sel, _ := json.Marshal(selector + " tr")
	rows, err := chromedp.Run(b.ctx, chromedp.Evaluate[[][]string](
		`[...document.querySelectorAll(`+string(sel)+`)].filter(r => r.querySelector("td")).map(r => [...r.cells].map(c => c.innerText.trim()))`))
	if err != nil {
		b.fail("read the rows of %s: %v", selector, err)
	}
	return rows
}

// screenshot takes a PNG of the viewport and writes it to the screenshot folder as name,
// when ONCEFLOW_SCREENSHOTS names one.
func (b *tab) screenshot(name string) {
	b.t.Helper()
	b.ready()
	png, err := chromedp.Run(b.ctx, chromedp.CaptureScreenshot())
	if err != nil || !bytes.HasPrefix(png, []byte("\x89PNG")) {
		b.fail("screenshot %s: not a PNG (%v)", name, err)
	}
	if b.shots == "" {
		return
	}
	if err := os.WriteFile(filepath.Join(b.shots, name), png, 0o644); err != nil {
		b.t.Fatal(err)
	}
}

// syncBuffer is a buffer that several goroutines write (the browser's output, the console's
// log).
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *syncBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *syncBuffer) String() string { l.mu.Lock(); defer l.mu.Unlock(); return l.b.String() }

// browserOutput is what the shared browser wrote to stderr so far, without its complaints
// that there is no D-Bus (harmless in a container).
func browserOutput() string {
	browser.mu.Lock()
	out := browser.out
	browser.mu.Unlock()
	if out == nil {
		return ""
	}
	var keep []string
	for _, l := range strings.Split(out.String(), "\n") {
		if !strings.Contains(l, ":ERROR:dbus/") {
			keep = append(keep, l)
		}
	}
	return strings.Join(keep, "\n")
}
