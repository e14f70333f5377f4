// Package browsertest holds the operator console's browser tests: a headless Chromium, driven
// with chromedp, against the real console handler on a real PostgreSQL. It is a module of its
// own, like internal/adopttest and bench/, so the library's go.mod never names chromedp and
// cdproto; `make test` runs it (go -C internal/browsertest test) and `make lint` tidies, vets
// and lints it.
//
// The tests need a Chromium (Debian's chromium, run as root with --headless=new --no-sandbox):
// with CI set a missing browser fails them, otherwise they skip. With ONCEFLOW_SCREENSHOTS set
// to a folder they write the screenshots docs/console.md shows:
//
//	ONCEFLOW_SCREENSHOTS=$PWD/docs/console go -C internal/browsertest test -run TestBrowser ./...
package browsertest
