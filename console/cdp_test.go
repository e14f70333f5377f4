package console_test

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"
)

// A headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe:
// JSON messages separated by NUL bytes on file descriptors 3 and 4). A hundred lines here
// instead of chromedp and its five modules in go.mod: the test needs navigate, click,
// evaluate and screenshot, nothing more.

// findChromium returns the browser binary. In CI (CI set) a missing browser fails the test,
// so the browser test can never be skipped there without anyone noticing.
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
	msg := "no chromium on PATH for the console's browser test: install it (Debian: apt-get install -y chromium; .ci/run does) or set ONCEFLOW_CHROMIUM to the browser binary"
	if os.Getenv("CI") != "" {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return ""
}

type cdpBrowser struct {
	t       *testing.T
	cmd     *exec.Cmd
	w       *os.File // commands, the browser's fd 3
	mu      sync.Mutex
	nextID  int
	waiting map[int]chan cdpReply
	session string
	stderr  *strings.Builder
}

type cdpReply struct {
	Result json.RawMessage `json:"result"`
	Error  *struct {
		Message string `json:"message"`
	} `json:"error"`
}

// startChromium starts a headless browser with one page attached, stopped when the test ends.
func startChromium(t *testing.T, bin string) *cdpBrowser {
	t.Helper()
	cmdR, cmdW, err := os.Pipe() // we write commands, the browser reads fd 3
	if err != nil {
		t.Fatal(err)
	}
	evR, evW, err := os.Pipe() // the browser writes fd 4, we read
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--headless=new", "--no-sandbox", "--remote-debugging-pipe", "--user-data-dir="+t.TempDir(),
		"--disable-gpu", "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars",
		"--window-size=1100,760", "about:blank")
	cmd.ExtraFiles = []*os.File{cmdR, evW}
	stderr := &strings.Builder{}
	cmd.Stderr = &lockedWriter{b: stderr} // dbus warnings, harmless; shown if the test fails
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	_ = cmdR.Close()
	_ = evW.Close()
	b := &cdpBrowser{t: t, cmd: cmd, w: cmdW, waiting: map[int]chan cdpReply{}, stderr: stderr}
	done := make(chan struct{})
	go b.read(evR, done)
	t.Cleanup(func() {
		_ = cmdW.Close() // the browser exits when its command pipe closes
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		_ = evR.Close()
		<-done
	})
	var target struct{ TargetID string }
	b.call("Target.createTarget", map[string]any{"url": "about:blank"}, &target)
	var att struct{ SessionID string }
	b.call("Target.attachToTarget", map[string]any{"targetId": target.TargetID, "flatten": true}, &att)
	b.session = att.SessionID
	b.call("Emulation.setDeviceMetricsOverride", map[string]any{"width": 1100, "height": 760, "deviceScaleFactor": 1, "mobile": false}, nil)
	return b
}

type lockedWriter struct {
	mu sync.Mutex
	b  *strings.Builder
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (b *cdpBrowser) read(r *os.File, done chan struct{}) {
	defer close(done)
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 64<<20) // screenshots arrive as one base64 message
	sc.Split(func(data []byte, atEOF bool) (int, []byte, error) {
		for i, c := range data {
			if c == 0 {
				return i + 1, data[:i], nil
			}
		}
		if atEOF && len(data) > 0 {
			return len(data), data, nil
		}
		return 0, nil, nil
	})
	for sc.Scan() {
		var m struct {
			ID int `json:"id"`
			cdpReply
		}
		if json.Unmarshal(sc.Bytes(), &m) != nil || m.ID == 0 {
			continue // an event: the test polls the page's state instead
		}
		b.mu.Lock()
		ch := b.waiting[m.ID]
		delete(b.waiting, m.ID)
		b.mu.Unlock()
		if ch != nil {
			ch <- m.cdpReply
		}
	}
	b.mu.Lock()
	for id, ch := range b.waiting {
		close(ch)
		delete(b.waiting, id)
	}
	b.mu.Unlock()
}

// call sends one command to the page's session (or to the browser before one is attached)
// and decodes its result into out.
func (b *cdpBrowser) call(method string, params any, out any) {
	b.t.Helper()
	if err := b.try(method, params, out); err != nil {
		b.t.Fatalf("%s: %v", method, err)
	}
}

// try is call, returning the browser's refusal of the command as an error.
func (b *cdpBrowser) try(method string, params any, out any) error {
	b.t.Helper()
	b.mu.Lock()
	b.nextID++
	id := b.nextID
	ch := make(chan cdpReply, 1)
	b.waiting[id] = ch
	b.mu.Unlock()
	msg := map[string]any{"id": id, "method": method, "params": params}
	if b.session != "" {
		msg["sessionId"] = b.session
	}
	raw, _ := json.Marshal(msg)
	if _, err := b.w.Write(append(raw, 0)); err != nil {
		b.t.Fatalf("%s: write to the browser: %v\n%s", method, err, b.stderr.String())
	}
	select {
	case rep, ok := <-ch:
		if !ok {
			b.t.Fatalf("%s: the browser went away\n%s", method, b.stderr.String())
		}
		if rep.Error != nil {
			return errors.New(rep.Error.Message)
		}
		if out != nil {
			if err := json.Unmarshal(rep.Result, out); err != nil {
				b.t.Fatalf("%s: decode %s: %v", method, rep.Result, err)
			}
		}
	case <-time.After(30 * time.Second):
		b.t.Fatalf("%s: no answer from the browser in 30 s\n%s", method, b.stderr.String())
	}
	return nil
}

// eval runs a JavaScript expression in the page (the DevTools protocol is not subject to
// the page's Content-Security-Policy) and returns its value as JSON.
func (b *cdpBrowser) eval(expr string) json.RawMessage {
	b.t.Helper()
	var res struct {
		Result struct {
			Value json.RawMessage `json:"value"`
		} `json:"result"`
		ExceptionDetails *struct {
			Text string `json:"text"`
		} `json:"exceptionDetails"`
	}
	b.call("Runtime.evaluate", map[string]any{"expression": expr, "returnByValue": true}, &res)
	if res.ExceptionDetails != nil {
		b.t.Fatalf("evaluate %q: %s", expr, res.ExceptionDetails.Text)
	}
	return res.Result.Value
}

func (b *cdpBrowser) str(expr string) string {
	var s string
	_ = json.Unmarshal(b.eval(expr), &s)
	return s
}

// waitFor polls until the page's location contains want and the document has loaded. A poll
// that lands while the page is being replaced is refused by the browser ("Inspected target
// navigated or closed", or its execution context is gone): that is a page still on its way, so
// it polls again.
func (b *cdpBrowser) waitFor(ctx context.Context, want string) {
	b.t.Helper()
	for {
		var res struct {
			Result struct {
				Value string `json:"value"`
			} `json:"result"`
		}
		err := b.try("Runtime.evaluate", map[string]any{"expression": `location.href + " " + document.readyState`, "returnByValue": true}, &res)
		if loc := res.Result.Value; err == nil && strings.Contains(loc, want) && strings.HasSuffix(loc, " complete") {
			return
		}
		select {
		case <-ctx.Done():
			b.t.Fatalf("the page never reached %q; it is at %s:\n%s", want, b.str("location.href"), b.str("document.body ? document.body.innerText : ''"))
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func (b *cdpBrowser) navigate(ctx context.Context, url string) {
	b.t.Helper()
	b.call("Page.navigate", map[string]any{"url": url}, nil)
	b.waitFor(ctx, url)
}

// click clicks the element selector names and waits for the page it leads to.
func (b *cdpBrowser) click(ctx context.Context, selector, leadsTo string) {
	b.t.Helper()
	sel, _ := json.Marshal(selector)
	var res struct {
		Result struct {
			Value bool `json:"value"`
		} `json:"result"`
	}
	err := b.try("Runtime.evaluate", map[string]any{"expression": fmt.Sprintf(`(() => { const e = document.querySelector(%s); if (!e) return false; e.click(); return true })()`, sel), "returnByValue": true}, &res)
	switch {
	case err != nil && strings.Contains(err.Error(), "navigated"):
		// The click led away before the browser answered: it was clicked.
	case err != nil:
		b.t.Fatalf("click %s: %v", selector, err)
	case !res.Result.Value:
		b.t.Fatalf("no %s on %s:\n%s", selector, b.str("location.href"), b.str("document.body.innerText"))
	}
	b.waitFor(ctx, leadsTo)
}

func (b *cdpBrowser) text() string { return b.str("document.body.innerText") }

// screenshot writes a PNG of the viewport to dir/name, when dir is set.
func (b *cdpBrowser) screenshot(dir, name string) {
	b.t.Helper()
	var shot struct{ Data string }
	b.call("Page.captureScreenshot", map[string]any{"format": "png"}, &shot)
	png, err := base64.StdEncoding.DecodeString(shot.Data)
	if err != nil || len(png) < 8 || string(png[1:4]) != "PNG" {
		b.t.Fatalf("screenshot %s: not a PNG (%v)", name, err)
	}
	if dir == "" {
		return
	}
	if err := os.WriteFile(dir+"/"+name, png, 0o644); err != nil {
		b.t.Fatal(err)
	}
}
