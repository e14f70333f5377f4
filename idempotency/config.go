package idempotency

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/textproto"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/onceflow/onceflow/internal/config"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgsql"
	cleaning "github.com/onceflow/onceflow/internal/retention"
)

// Defaults of Config.
const (
	// DefaultWindow is how long a stored response is replayed: 24 hours, the lifetime the
	// published contract promises clients (docs/http-idempotency.md, "Expiry").
	DefaultWindow = 24 * time.Hour
	// DefaultMaxBodyBytes is the largest request body accepted on a covered request: 1 MiB.
	DefaultMaxBodyBytes = 1 << 20
	// DefaultMaxStoredResponseBytes is the largest response body stored for replay: 1 MiB.
	DefaultMaxStoredResponseBytes = 1 << 20
	// DefaultRetryAfter is the Retry-After advertised with a 409 for a request in flight.
	DefaultRetryAfter = time.Second
	// DefaultMaxWaiters is the default Config.MaxWaiters: at most 64 requests of one
	// middleware wait for keys held by other requests (WaitInFlight) at once.
	DefaultMaxWaiters = 64
	// DefaultProblemBase prefixes every problem type URI; each type is a section of the
	// published contract (docs/http-idempotency.md), as the draft asks error responses to
	// link to the documentation.
	DefaultProblemBase = "https://github.com/onceflow/onceflow/blob/main/docs/http-idempotency.md#"
)

// DefaultMethods are the methods covered unless Config.Methods says otherwise: the
// non-idempotent methods of RFC 9110.
var DefaultMethods = []string{http.MethodPost, http.MethodPatch}

// DefaultStoredHeaders are the response headers stored and replayed unless
// Config.StoredHeaders says otherwise. Set-Cookie and other per-response headers never are.
var DefaultStoredHeaders = []string{"Content-Type", "Location", "Content-Location", "ETag", "Last-Modified", "Link"}

// neverStored are headers that must never be replayed: cookies and authentication state are
// per response, hop-by-hop and framing headers describe one connection, and the replay marker
// is added by the middleware itself.
var neverStored = []string{"Set-Cookie", "Set-Cookie2", "Authorization", "Proxy-Authenticate", "WWW-Authenticate",
	"Connection", "Keep-Alive", "Transfer-Encoding", "Content-Length", "Trailer", "Upgrade", HeaderReplayed}

// DefaultStore is the default Config.Store: 2xx and 4xx responses are stored (and the
// handler's writes committed) except 408 Request Timeout, 425 Too Early and 429 Too Many
// Requests, which say "try again later" and must not be frozen into every retry.
// Everything else (1xx, 3xx, 5xx) is rolled back and not stored.
func DefaultStore(status int) bool {
	switch {
	case status == http.StatusRequestTimeout, status == http.StatusTooEarly, status == http.StatusTooManyRequests:
		return false
	case status >= 200 && status < 300, status >= 400 && status < 500:
		return true
	}
	return false
}

// ErrNoOwner is what Config.Owner returns (possibly wrapped) for a request it cannot assign
// to an owner, such as an anonymous one; the middleware answers 401 problem+json. Any other
// error from Owner is treated as a server failure (500).
var ErrNoOwner = errors.New("idempotency: the request has no owner")

// Config configures the middleware. Pool and Owner are required; every other field has a
// documented default.
type Config struct {
	// Pool runs the request's transaction. Required.
	Pool *pgxpool.Pool
	// Schema holds the idempotency_record table. Default "onceflow".
	Schema string
	// Owner returns who the request acts for, e.g. the authenticated user or tenant. Records
	// are scoped by (owner, key): one owner never sees another's stored response. Required;
	// authentication must run before the middleware. Return ErrNoOwner for anonymous requests
	// (answered 401); an empty owner is treated the same way.
	Owner func(*http.Request) (string, error)

	// Methods covered by the middleware; requests with other methods pass through untouched.
	// Default DefaultMethods (POST, PATCH).
	Methods []string
	// Required makes Handler answer 400 when a covered request has no Idempotency-Key.
	// Default false: such requests pass through untouched (no transaction, nothing stored).
	// Middleware.Require requires the key on one route whatever this says.
	Required bool

	// Window is how long a stored response is replayed, from the start of the first request's
	// transaction, on the database clock: the record's expires_at. Default DefaultWindow
	// (24 h). A Window under retention.MinWindow (24 h) is refused unless AllowShortWindow is
	// set. Expired records count as absent at once; Cleaner reclaims their space.
	Window time.Duration
	// AllowShortWindow accepts a Window under retention.MinWindow (24 h), for tests and
	// clients whose retry horizon is provably short. Default false: such a window is refused.
	AllowShortWindow bool

	// MaxBodyBytes refuses larger request bodies with 413 before anything is stored.
	// Default DefaultMaxBodyBytes (1 MiB).
	MaxBodyBytes int64
	// MaxStoredResponseBytes caps the response body stored for replay. A larger response is
	// still sent in full to the first caller; its record keeps status and headers but no body,
	// and a retry gets 410 problem+json of type "response-not-stored" (the handler does not
	// run again). Default DefaultMaxStoredResponseBytes (1 MiB).
	MaxStoredResponseBytes int
	// CanonicalJSON fingerprints JSON request bodies (Content-Type application/json or
	// */*+json) in canonical form, so key order and whitespace do not make a retry a
	// different request. Default false: the raw bytes are fingerprinted.
	CanonicalJSON bool
	// Route returns the path part of the fingerprint. Default: the request's escaped URL path,
	// so the same key sent to /orders/1 and /orders/2 is a mismatch. (r.Pattern is not the
	// default: it would make those two requests the same command.)
	Route func(*http.Request) string

	// Store decides from the handler's status whether its response is stored and its
	// transaction committed. When it returns false the transaction rolls back (the handler's
	// writes too), the response is sent as is, and a retry runs the handler again.
	// Default DefaultStore.
	Store func(status int) bool
	// StoredHeaders lists the response headers stored and replayed.
	// Default DefaultStoredHeaders. Set-Cookie, hop-by-hop and framing headers are refused.
	StoredHeaders []string

	// MismatchStatus answers a key reused with a different request: 422 (the draft's choice,
	// the default) or 409.
	MismatchStatus int
	// WaitInFlight makes a request whose key is held by a request still running wait up to
	// this long for it to finish and then replay its response (or run, if the first one
	// rolled back). Default 0: answer 409 with Retry-After at once. A waiting request holds no
	// pooled connection: it retries the key's lock in short transactions, 10 ms after the
	// first try and then backing off to every 100 ms, and is woken at once when the request
	// holding the key runs in the same process.
	WaitInFlight time.Duration
	// MaxWaiters bounds the requests waiting at once (WaitInFlight) in this middleware; a
	// request that would be one more gets 409 at once. Default DefaultMaxWaiters (64).
	MaxWaiters int
	// RetryAfter is advertised (rounded up to whole seconds) with a 409 in-flight answer and a
	// 503 storage failure. Default DefaultRetryAfter (1 s).
	RetryAfter time.Duration
	// ProblemBase prefixes the problem type URIs (the type name is appended).
	// Default DefaultProblemBase.
	ProblemBase string

	// Logger receives storage failures, panics and owner errors (at Error level), and at
	// Debug level requests whose client went away before the key was claimed. Default
	// slog.Default().
	Logger *slog.Logger
	// Metrics observes the outcome of every covered request that carries a key. Default NopMetrics{}.
	Metrics Metrics
}

// Outcome names what the middleware did with a keyed request, for Metrics.
type Outcome string

// Outcomes reported to Metrics.
const (
	OutcomeStored      Outcome = "stored"       // handler ran, response stored, transaction committed
	OutcomeNotStored   Outcome = "not_stored"   // handler ran, Store said no: rolled back
	OutcomeReplayed    Outcome = "replayed"     // stored response replayed, handler not run
	OutcomeMismatch    Outcome = "mismatch"     // key reused with a different request
	OutcomeInFlight    Outcome = "in_flight"    // key held by a running request: 409
	OutcomeNoBody      Outcome = "not_replayed" // stored without body (over the cap): 410
	OutcomeRejected    Outcome = "rejected"     // malformed key, missing key, body too large, no owner
	OutcomeStorageFail Outcome = "storage_error"
	// OutcomeCanceled: the request's context was cancelled — the client went away — while the
	// middleware was taking a connection, beginning the transaction or claiming the key, so
	// the handler did not run and nothing was stored. Not a storage failure: a client that
	// hangs up early retries, or does not care. (A client that hangs up after the handler
	// returned gets OutcomeStored: the response commits on a detached context.)
	OutcomeCanceled Outcome = "canceled"
	OutcomePanic    Outcome = "panic" // handler panicked: rolled back, panic propagated
	// OutcomeTxMisuse: the handler tried to end its transaction with SQL (COMMIT, ROLLBACK, ...),
	// ended it around the managed view, or answered a stored status with the transaction
	// aborted by a failed statement: rolled back, nothing stored, 500.
	OutcomeTxMisuse Outcome = "tx_misuse"
)

// Metrics receives one observation per keyed request. Implementations must be safe for
// concurrent use; a Prometheus counter and histogram vector fit in a few lines.
type Metrics interface {
	Observe(outcome Outcome, elapsed time.Duration)
}

// withDefaults fills defaults and reports every problem at once.
func (c Config) withDefaults() (Config, error) {
	var problems []error
	if c.Pool == nil {
		problems = append(problems, errors.New("Pool is nil; pass the *pgxpool.Pool that holds the idempotency_record table"))
	}
	if c.Owner == nil {
		problems = append(problems, errors.New("Owner is nil; supply a function returning the authenticated owner of the request (keys are scoped per owner, so one client can never read another's response)"))
	}
	if c.Schema == "" {
		c.Schema = pgsql.DefaultSchema
	}
	if err := pgsql.ValidateSchema(c.Schema); err != nil {
		problems = append(problems, fmt.Errorf("Schema: %w", err))
	}
	if len(c.Methods) == 0 {
		c.Methods = DefaultMethods
	}
	methods := make([]string, 0, len(c.Methods))
	for _, m := range c.Methods {
		if m == "" || strings.IndexFunc(m, func(r rune) bool { return r > 0x7e || !isTchar(byte(r)) }) >= 0 {
			problems = append(problems, fmt.Errorf("Methods: %q is not an HTTP method token", m))
			continue
		}
		methods = append(methods, m)
	}
	c.Methods = methods
	if c.Window == 0 {
		c.Window = DefaultWindow
	}
	if err := cleaning.CheckWindow("Window", c.Window, c.AllowShortWindow, "AllowShortWindow"); err != nil {
		problems = append(problems, err)
	}
	if c.MaxBodyBytes < 0 {
		problems = append(problems, fmt.Errorf("MaxBodyBytes is %d; use 0 for the default (%d) or a positive limit", c.MaxBodyBytes, DefaultMaxBodyBytes))
	} else if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if c.MaxStoredResponseBytes < 0 {
		problems = append(problems, fmt.Errorf("MaxStoredResponseBytes is %d; use 0 for the default (%d) or a positive limit", c.MaxStoredResponseBytes, DefaultMaxStoredResponseBytes))
	} else if c.MaxStoredResponseBytes == 0 {
		c.MaxStoredResponseBytes = DefaultMaxStoredResponseBytes
	}
	if c.Route == nil {
		c.Route = func(r *http.Request) string { return r.URL.EscapedPath() }
	}
	if c.Store == nil {
		c.Store = DefaultStore
	}
	if c.StoredHeaders == nil {
		c.StoredHeaders = DefaultStoredHeaders
	}
	headers := make([]string, 0, len(c.StoredHeaders))
	for _, h := range c.StoredHeaders {
		ch := textproto.CanonicalMIMEHeaderKey(h)
		switch {
		case h == "" || strings.IndexFunc(h, func(r rune) bool { return r > 0x7e || !isTchar(byte(r)) }) >= 0:
			problems = append(problems, fmt.Errorf("StoredHeaders: %q is not a header name", h))
		case slices.Contains(neverStored, ch):
			problems = append(problems, fmt.Errorf("StoredHeaders: %s is never stored or replayed (it belongs to one response or connection); remove it", ch))
		default:
			headers = append(headers, ch)
		}
	}
	c.StoredHeaders = headers
	switch c.MismatchStatus {
	case 0:
		c.MismatchStatus = http.StatusUnprocessableEntity
	case http.StatusUnprocessableEntity, http.StatusConflict:
	default:
		problems = append(problems, fmt.Errorf("MismatchStatus is %d; use 422 (the draft's choice, default) or 409", c.MismatchStatus))
	}
	if c.WaitInFlight < 0 {
		problems = append(problems, fmt.Errorf("WaitInFlight is %s; use 0 to answer 409 at once, or a positive bound", c.WaitInFlight))
	}
	if c.MaxWaiters < 0 {
		problems = append(problems, fmt.Errorf("MaxWaiters is %d; use 0 for the default (%d) or a positive bound", c.MaxWaiters, DefaultMaxWaiters))
	} else if c.MaxWaiters == 0 {
		c.MaxWaiters = DefaultMaxWaiters
	}
	if c.RetryAfter < 0 {
		problems = append(problems, fmt.Errorf("RetryAfter is %s; use 0 for the default (%s) or a positive duration", c.RetryAfter, DefaultRetryAfter))
	} else if c.RetryAfter == 0 {
		c.RetryAfter = DefaultRetryAfter
	}
	if c.ProblemBase == "" {
		c.ProblemBase = DefaultProblemBase
	}
	if _, err := url.Parse(c.ProblemBase); err != nil {
		problems = append(problems, fmt.Errorf("ProblemBase: %w", err))
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Metrics == nil {
		c.Metrics = NopMetrics{}
	}
	if err := config.Check("idempotency", problems...); err != nil {
		return c, err
	}
	return c, nil
}
