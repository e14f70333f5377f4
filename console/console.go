// Package console is onceflow's operator console: server-rendered pages that show whether
// anything is stuck (relays, outbox backlog, parked rows, poison messages, sagas) and, when
// actions are switched on, recover it (retry or compensate a saga, replay parked outbox rows,
// delete handled poison rows).
//
// New returns an http.Handler. Mount it in a service behind the service's own authentication
// middleware, or run `onceflow ui`, which requires a credential unless it listens on loopback:
//
//	h, err := console.New(console.Config{DB: pool, Schema: "onceflow", Prefix: "/ops"})
//	mux.Handle("/ops/", requireOperator(h))
//
// The console is read-only unless Config.Actions is set. Every action is a POST with a CSRF
// token, refused without it; every page carries a strict Content-Security-Policy (no script
// at all: the overview refreshes itself with a meta refresh); every value is escaped by
// html/template; no connection string is ever rendered. Invalid ids and filters get a 400 page
// and change nothing. Each action is logged with the user (see ContextWithUser) and what it
// did.
package console

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/audit"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/saga"
	"github.com/onceflow/onceflow/status"
)

// DB is what the console needs from the database: a *pgxpool.Pool (or a *pgx.Conn, for a
// console that serves one request at a time).
type DB interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Config configures the console. Only DB is required.
type Config struct {
	// DB holds the onceflow tables (required).
	DB DB
	// Schema holding the onceflow tables. Default "onceflow".
	Schema string
	// Prefix is the path the handler is mounted at, e.g. "/ops" for mux.Handle("/ops/", h):
	// links are built under it and requests outside it are not found. Default "" (the root).
	Prefix string
	// Actions switches on the buttons that change something: saga retry and compensate,
	// replay of parked outbox rows, deletion of poison rows. Default false: read-only.
	Actions bool
	// Thresholds decide what the overview reports stuck. Default: status.DefaultThresholds().
	Thresholds status.Thresholds
	// Refresh is how often the overview reloads itself. Default 10 s; negative: never.
	Refresh time.Duration
	// Logger receives one line per action (who, what, outcome). Default slog.Default().
	Logger *slog.Logger
	// Hosts are the Host header values the console answers: "host" (any port) or
	// "host:port", e.g. "ops.example.com" behind a reverse proxy that passes the Host on. A
	// request for another host gets 421 and a log line, so a page of another site that
	// rebinds its DNS name to the console's address (DNS rebinding) reads and posts nothing.
	// Default none: every host, for a console mounted in a service whose router and
	// credential check come first; set it whenever the console answers without a credential
	// (`onceflow ui` sets its listen address and localhost).
	Hosts []string
	// Sagas are the saga definitions the service runs (any *saga.Definition[D]), if the
	// console is mounted where they are at hand: with a saga's definition the console refuses
	// to compensate a saga past its pivot up front, instead of filing a request the
	// orchestrator drops. Optional.
	Sagas []saga.Known
}

// validate fills the defaults and reports every problem at once.
func (c *Config) validate() error {
	var problems []string
	if c.DB == nil {
		problems = append(problems, "DB is nil: pass the *pgxpool.Pool holding the onceflow tables")
	}
	if c.Schema == "" {
		c.Schema = pgsql.DefaultSchema
	}
	if err := pgsql.ValidateSchema(c.Schema); err != nil {
		problems = append(problems, err.Error())
	}
	c.Prefix = strings.TrimSuffix(c.Prefix, "/")
	if c.Prefix != "" && (!strings.HasPrefix(c.Prefix, "/") || strings.ContainsAny(c.Prefix, "?#\"'<> ")) {
		problems = append(problems, fmt.Sprintf("Prefix %q is not a path like /ops", c.Prefix))
	}
	for i, h := range c.Hosts {
		c.Hosts[i] = strings.ToLower(h)
		if h == "" || strings.ContainsAny(h, "/?#@ \t") {
			problems = append(problems, fmt.Sprintf("Hosts[%d] %q is not a host name or host:port like ops.example.com or 127.0.0.1:8080", i, h))
		}
	}
	if c.Thresholds == (status.Thresholds{}) {
		c.Thresholds = status.DefaultThresholds()
	}
	if c.Refresh == 0 {
		c.Refresh = 10 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if len(problems) > 0 {
		return fmt.Errorf("console: %s", strings.Join(problems, "; "))
	}
	return nil
}

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// Console is the console's http.Handler.
type Console struct {
	cfg   Config
	sagas *saga.Admin
	idem  *idempotency.Admin
	relay *relay.Admin
	inbox *inbox.Admin
	pages map[string]*template.Template
	mux   *http.ServeMux
}

// New returns the console for cfg.
func New(cfg Config) (*Console, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	sa, err := saga.NewAdmin(cfg.Schema, cfg.Sagas...)
	if err != nil {
		return nil, err
	}
	ra, err := relay.NewAdmin(cfg.Schema)
	if err != nil {
		return nil, err
	}
	ia, err := idempotency.NewAdmin(cfg.Schema)
	if err != nil {
		return nil, err
	}
	xa, err := inbox.NewAdmin(cfg.Schema)
	if err != nil {
		return nil, err
	}
	c := &Console{cfg: cfg, sagas: sa, relay: ra, idem: ia, inbox: xa, pages: map[string]*template.Template{}}
	if err := c.parseTemplates(); err != nil {
		return nil, err
	}
	c.routes()
	return c, nil
}

func (c *Console) routes() {
	m := http.NewServeMux()
	static, _ := fs.Sub(staticFS, "static")
	m.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	m.Handle("GET /{$}", c.page(c.overview))
	m.Handle("GET /sagas", c.page(c.sagaList))
	m.Handle("GET /sagas/{id}", c.page(c.sagaPage))
	m.Handle("GET /sagas/{id}/{action}", c.page(c.sagaConfirm))
	m.Handle("POST /sagas/{id}/{action}", c.action(c.sagaAction))
	m.Handle("GET /versions", c.page(c.versions))
	m.Handle("GET /audit", c.page(c.auditList))
	m.Handle("GET /versions/{name}/{version}/upgrade", c.page(c.upgradeConfirm))
	m.Handle("POST /versions/{name}/{version}/upgrade", c.action(c.upgradeAction))
	m.Handle("GET /bulk/sagas/{action}", c.page(c.bulkConfirm))
	m.Handle("POST /bulk/sagas/{action}", c.action(c.bulkAction))
	m.Handle("GET /outbox", c.page(c.outboxPage))
	m.Handle("GET /outbox/find", c.page(c.outboxFind))
	m.Handle("GET /outbox/parked", c.page(c.outboxParked))
	m.Handle("GET /outbox/replay", c.page(c.outboxReplayConfirm))
	m.Handle("POST /outbox/replay", c.action(c.outboxReplay))
	m.Handle("GET /inbox", c.page(c.inboxPage))
	m.Handle("GET /inbox/delete", c.page(c.poisonBulkConfirm))
	m.Handle("POST /inbox/delete", c.action(c.poisonBulkDelete))
	m.Handle("GET /inbox/replay", c.page(c.poisonBulkReplayConfirm))
	m.Handle("POST /inbox/replay", c.action(c.poisonBulkReplay))
	m.Handle("GET /inbox/parked/release", c.page(c.releaseAllConfirm))
	m.Handle("POST /inbox/parked/release", c.action(c.releaseAll))
	m.Handle("GET /inbox/parked/{id}/release", c.page(c.releaseConfirm))
	m.Handle("POST /inbox/parked/{id}/release", c.action(c.releaseOne))
	m.Handle("GET /inbox/{id}", c.page(c.poisonPage))
	m.Handle("GET /inbox/{id}/delete", c.page(c.poisonDeleteConfirm))
	m.Handle("POST /inbox/{id}/delete", c.action(c.poisonDelete))
	m.Handle("GET /inbox/{id}/replay", c.page(c.poisonReplayConfirm))
	m.Handle("POST /inbox/{id}/replay", c.action(c.poisonReplay))
	m.Handle("GET /idempotency", c.page(c.idempotencyPage))
	m.Handle("/", c.page(func(http.ResponseWriter, *http.Request) error { return errNoPage }))
	c.mux = m
}

// ServeHTTP serves the console's pages under Config.Prefix.
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	// No script runs anywhere; styles and images come from the console itself; forms post
	// only to it; no other site may frame it (clickjacking of the action buttons).
	h.Set("Content-Security-Policy", "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("X-Frame-Options", "DENY")
	// same-origin, not no-referrer: under no-referrer a browser posts the console's own forms
	// with "Origin: null", which checkPost must refuse.
	h.Set("Referrer-Policy", "same-origin")
	h.Set("Cache-Control", "no-store")
	if !c.servesHost(r.Host) {
		c.cfg.Logger.Warn("console: request for a host this console does not serve refused (Config.Hosts, onceflow ui --host)",
			"host", r.Host, "method", r.Method, "path", r.URL.Path, "remote", r.RemoteAddr)
		http.Error(w, "421 misdirected request: this console does not serve the host "+strconv.Quote(r.Host)+
			"; its operator can add the name with onceflow ui --host (console.Config.Hosts)", http.StatusMisdirectedRequest)
		return
	}
	// The Admin calls record operator actions with this name (package audit).
	r = r.WithContext(audit.WithActor(r.Context(), userOf(r)))
	path := r.URL.Path
	if c.cfg.Prefix != "" {
		if path != c.cfg.Prefix && !strings.HasPrefix(path, c.cfg.Prefix+"/") {
			// Not the console's page: a plain 404, without the rendered page's CSRF cookie,
			// which would replace the operator's token (a browser's own /favicon.ico).
			http.Error(w, "404 page not found (the console is under "+c.cfg.Prefix+"/)", http.StatusNotFound)
			return
		}
		path = strings.TrimPrefix(path, c.cfg.Prefix)
		if path == "" {
			path = "/"
		}
		r2 := r.Clone(r.Context())
		r2.URL.Path = path
		// The escaped form too (as http.StripPrefix does): a saga id may contain "/", which
		// only the escaped path keeps inside one segment.
		r2.URL.RawPath = strings.TrimPrefix(r.URL.RawPath, c.cfg.Prefix)
		r = r2
	}
	c.mux.ServeHTTP(w, r)
}

type userKey struct{}

// ContextWithUser returns ctx carrying the name of the authenticated user, which the console
// logs with every action. Set it in the authentication middleware in front of the console;
// without it the console logs the basic-auth user name, or "anonymous".
func ContextWithUser(ctx context.Context, name string) context.Context {
	return context.WithValue(ctx, userKey{}, name)
}

func userOf(r *http.Request) string {
	if u, ok := r.Context().Value(userKey{}).(string); ok && u != "" {
		return u
	}
	if u, _, ok := r.BasicAuth(); ok && u != "" {
		return u
	}
	return "anonymous"
}

// pageError is an error a handler returns to answer with its own status and message: the
// request's fault (400), a page or row that does not exist (404), a refused post (403).
type pageError struct {
	status int
	msg    string
}

func (e *pageError) Error() string { return e.msg }

func pageErr(status int, msg string) error { return &pageError{status: status, msg: msg} }

// badInput is the 400 answer to a request the console cannot act on, saying why.
func badInput(format string, args ...any) error {
	return &pageError{status: http.StatusBadRequest, msg: fmt.Sprintf(format, args...)}
}

// errNoPage answers an address with no page.
var errNoPage = pageErr(http.StatusNotFound, "There is no page at this address.")

// inputText is the message of a request's own error (bad input), ok false for any other
// error (the database's).
func inputText(err error) (msg string, ok bool) {
	var pe *pageError
	if errors.As(err, &pe) && pe.status == http.StatusBadRequest {
		return pe.msg, true
	}
	return "", false
}

// page adapts a handler that returns its failure: every page's errors are answered in one
// place (failErr).
func (c *Console) page(h func(http.ResponseWriter, *http.Request) error) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := h(w, r); err != nil {
			c.failErr(w, r, err)
		}
	})
}

// action adapts a handler of a form's POST: checkPost first (actions on, an operator's
// credential, the CSRF token, the origin), then the handler, its failure answered by failErr.
func (c *Console) action(h func(http.ResponseWriter, *http.Request) error) http.Handler {
	return c.page(func(w http.ResponseWriter, r *http.Request) error {
		if err := c.checkPost(w, r); err != nil {
			return err
		}
		return h(w, r)
	})
}

// failErr renders the page for err: its own status for a pageError, 400 with its text for a
// request the packages refuse (a saga in another state, a bad filter, an empty replay
// filter), 404 for a missing saga, 500 (text logged, not
// shown) otherwise: a database error can name internals an operator's browser need not see.
func (c *Console) failErr(w http.ResponseWriter, r *http.Request, err error) {
	var pe *pageError
	switch {
	case errors.As(err, &pe):
		c.fail(w, r, pe.status, pe.msg)
	case errors.Is(err, saga.ErrNotFound):
		c.fail(w, r, http.StatusNotFound, err.Error())
	case errors.Is(err, saga.ErrWrongState), errors.Is(err, saga.ErrBadFilter), errors.Is(err, relay.ErrEmptyReplayFilter):
		c.fail(w, r, http.StatusBadRequest, err.Error())
	case r.Context().Err() != nil:
		// The client went away; nothing to render.
	default:
		c.cfg.Logger.Error("console: request failed", "method", r.Method, "path", r.URL.Path, "user", userOf(r), "err", err)
		c.fail(w, r, http.StatusInternalServerError, "The database query failed; the service's log has the error.")
	}
}

func (c *Console) fail(w http.ResponseWriter, r *http.Request, status int, msg string) {
	c.render(w, r, status, "error", map[string]any{"Status": status, "StatusText": http.StatusText(status), "Message": msg})
}

// servesHost reports whether host (a request's Host header) is one of Config.Hosts: an entry
// without a port matches the host at any port.
func (c *Console) servesHost(host string) bool {
	if len(c.cfg.Hosts) == 0 {
		return true
	}
	host = strings.ToLower(host)
	name := host
	if h, _, err := net.SplitHostPort(host); err == nil {
		name = h
	}
	for _, want := range c.cfg.Hosts {
		if want == host || strings.Trim(want, "[]") == name {
			return true
		}
	}
	return false
}
