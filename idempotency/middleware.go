// Package idempotency is net/http middleware for the Idempotency-Key header
// (draft-ietf-httpapi-idempotency-key-header): a client that retries a POST or PATCH with the
// same key gets the first response again, and the handler runs once.
//
// The first request with a key runs in one PostgreSQL transaction that holds a lock on
// (owner, key), carries the handler's own writes (Tx returns it; outbox.TxFromContext does
// too, so domain events published from the handler land in the same transaction) and stores
// the response. The response is sent only after that transaction commits, so a response a
// client saw is always replayable, and a handler whose response is not stored (5xx, panic)
// leaves no trace: its writes roll back with it.
//
//	mw, err := idempotency.New(idempotency.Config{
//		Pool:  pool,
//		Owner: func(r *http.Request) (string, error) { return auth.UserID(r.Context()) },
//	})
//	mux.Handle("POST /orders", mw.Require(http.HandlerFunc(createOrder)))
//
//	func createOrder(w http.ResponseWriter, r *http.Request) {
//		tx := idempotency.Tx(r.Context())
//		_, err := tx.Exec(r.Context(), `INSERT INTO orders ...`)
//		...
//	}
//
// The middleware is a plain func(http.Handler) http.Handler (Handler and Require), so chi,
// echo (echo.WrapMiddleware) and gin (through an http.Handler adapter) use it as is. The
// contract it gives clients is published in docs/http-idempotency.md.
package idempotency

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/outbox"
)

// storeTimeout bounds storing the record and committing once the handler has returned. The
// request's own context is not used for that step: a client that hung up after the handler
// finished should still find the result stored when it retries.
const storeTimeout = 30 * time.Second

// ErrTxManaged is returned by Commit and Rollback on the transaction handed to a handler: the
// middleware commits it after storing the response, or rolls it back when the response is not
// stored. To abort, return a status that Config.Store does not store (any 5xx by default).
var ErrTxManaged = errors.New("idempotency: the middleware commits or rolls back this transaction itself; to abort the handler's writes, respond with a status that is not stored (e.g. 5xx)")

// Middleware makes covered requests that carry an Idempotency-Key run once. It is safe for
// concurrent use; build one per configuration and wrap as many handlers as needed.
type Middleware struct {
	cfg       Config
	methods   map[string]bool
	selectSQL string
	upsertSQL string
	// afterStore, when set (tests only), runs between storing the record and the commit.
	afterStore func()
}

// New validates cfg, reporting every problem at once, and returns the middleware. It refuses
// a config without Pool or Owner.
func New(cfg Config) (*Middleware, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	m := &Middleware{cfg: cfg, methods: map[string]bool{}}
	for _, method := range cfg.Methods {
		m.methods[method] = true
	}
	table := pgsql.Table(cfg.Schema, "idempotency_record")
	// now() is the transaction's start on the database clock: expiry never depends on the
	// application servers' clocks agreeing.
	m.selectSQL = `SELECT fingerprint, status, headers, body IS NOT NULL, coalesce(body, '') FROM ` + table +
		` WHERE owner = $1 AND idem_key = $2 AND expires_at > now()`
	// Only an expired record may be replaced; with the lock held and no live record seen this
	// always inserts or replaces, and a zero row count means something broke that invariant.
	m.upsertSQL = `INSERT INTO ` + table + ` AS r (owner, idem_key, fingerprint, status, headers, body, created_at, expires_at)
	VALUES ($1, $2, $3, $4, $5, $6, now(), now() + $7 * interval '1 microsecond')
	ON CONFLICT (owner, idem_key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, status = EXCLUDED.status,
		headers = EXCLUDED.headers, body = EXCLUDED.body, created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at
	WHERE r.expires_at <= now()`
	return m, nil
}

// Config returns the configuration with defaults filled in.
func (m *Middleware) Config() Config { return m.cfg }

// Handler wraps next. Covered requests (Config.Methods) with a key run once; covered requests
// without one get 400 when Config.Required is set and pass through otherwise.
func (m *Middleware) Handler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { m.serve(w, r, next, m.cfg.Required) })
}

// Require is Handler with the key mandatory on this route, whatever Config.Required says.
func (m *Middleware) Require(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { m.serve(w, r, next, true) })
}

type ctxKey struct{}

// Tx returns the transaction the middleware opened for the request being handled, or nil when
// the request runs without one (method not covered, or no key on an optional route). Use it
// for every write that must happen at most once: it commits together with the stored
// response. Commit and Rollback on it return ErrTxManaged.
func Tx(ctx context.Context) pgx.Tx {
	tx, _ := TxFromContext(ctx)
	return tx
}

// TxFromContext is Tx with an explicit found flag, for handlers that also serve requests
// without a key and then open their own transaction.
func TxFromContext(ctx context.Context) (pgx.Tx, bool) {
	tx, ok := ctx.Value(ctxKey{}).(pgx.Tx)
	return tx, ok && tx != nil
}

// managedTx is the handler's view of the request transaction: everything but ending it.
type managedTx struct{ pgx.Tx }

func (managedTx) Commit(context.Context) error   { return ErrTxManaged }
func (managedTx) Rollback(context.Context) error { return ErrTxManaged }

// record is a stored response.
type record struct {
	fingerprint []byte
	status      int
	headers     http.Header
	hasBody     bool
	body        []byte
}

func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler, required bool) {
	if !m.methods[r.Method] {
		next.ServeHTTP(w, r)
		return
	}
	start := time.Now()
	values := r.Header.Values(HeaderKey)
	switch {
	case len(values) == 0 && !required:
		next.ServeHTTP(w, r)
		return
	case len(values) == 0:
		m.observe(OutcomeRejected, start)
		m.writeProblem(w, http.StatusBadRequest, ProblemKeyMissing, "Idempotency-Key is missing",
			"This operation requires an Idempotency-Key header: send a unique value, e.g. a random UUID as a quoted string, and reuse it only to retry this same request.", nil)
		return
	case len(values) > 1:
		m.observe(OutcomeRejected, start)
		m.writeProblem(w, http.StatusBadRequest, ProblemKeyInvalid, "Idempotency-Key is invalid",
			fmt.Sprintf("The request has %d Idempotency-Key header lines; send exactly one.", len(values)), nil)
		return
	}
	key, err := ParseKey(values[0])
	if err != nil {
		m.observe(OutcomeRejected, start)
		m.writeProblem(w, http.StatusBadRequest, ProblemKeyInvalid, "Idempotency-Key is invalid",
			err.Error()+". Send one quoted string of 1 to 255 printable ASCII characters, e.g. a random UUID.", nil)
		return
	}
	owner, err := m.cfg.Owner(r)
	if err == nil && owner == "" {
		err = fmt.Errorf("%w: Owner returned an empty owner", ErrNoOwner)
	}
	if err != nil {
		m.observe(OutcomeRejected, start)
		if errors.Is(err, ErrNoOwner) {
			m.writeProblem(w, http.StatusUnauthorized, ProblemNoOwner, "Request owner unknown",
				"Idempotency keys are scoped to the authenticated caller; authenticate and retry with the same key.", nil)
			return
		}
		m.cfg.Logger.Error("idempotency: Owner failed", "err", err, "method", r.Method, "path", r.URL.Path)
		m.writeProblem(w, http.StatusInternalServerError, "", "Internal Server Error",
			"The owner of the request could not be determined. Nothing was executed; retry with the same key.", nil)
		return
	}
	body, tooLarge, err := readBody(r, m.cfg.MaxBodyBytes)
	if tooLarge {
		m.observe(OutcomeRejected, start)
		m.writeProblem(w, http.StatusRequestEntityTooLarge, ProblemBodyTooLarge, "Request body too large",
			fmt.Sprintf("Requests with an Idempotency-Key may carry at most %d bytes of body. Nothing was executed or stored.", m.cfg.MaxBodyBytes), nil)
		return
	}
	if err != nil {
		m.observe(OutcomeRejected, start)
		m.writeProblem(w, http.StatusBadRequest, "", "Bad Request", "The request body could not be read: "+err.Error(), nil)
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	fpBody := body
	if m.cfg.CanonicalJSON && isJSON(r.Header.Get("Content-Type")) {
		if c, ok := canonicalJSON(body); ok {
			fpBody = c
		}
	}
	fp := fingerprint(r.Method, m.cfg.Route(r), r.URL.RawQuery, fpBody)
	m.execute(w, r, next, start, owner, key, fp)
}

// readBody reads the whole body up to limit. tooLarge is set when it is longer.
func readBody(r *http.Request, limit int64) (body []byte, tooLarge bool, err error) {
	if r.ContentLength > limit {
		return nil, true, nil
	}
	if r.Body == nil {
		return nil, false, nil
	}
	body, err = io.ReadAll(io.LimitReader(r.Body, limit+1))
	if int64(len(body)) > limit {
		return nil, true, nil
	}
	return body, false, err
}

func (m *Middleware) execute(w http.ResponseWriter, r *http.Request, next http.Handler, start time.Time, owner, key string, fp []byte) {
	ctx := r.Context()
	// READ COMMITTED explicitly, whatever the server's default: the record is read by a
	// statement that starts after the lock was granted, and only at this level does that
	// statement see a record committed by the lock's previous holder.
	tx, err := m.cfg.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		m.storageFailure(w, start, "begin transaction", err)
		return
	}
	ended := false
	rollback := func() {
		if ended {
			return
		}
		ended = true
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = tx.Rollback(rctx) // on failure pgx closes the connection, which rolls back too
	}
	defer rollback()

	held, rec, err := m.claim(ctx, tx, lockID(m.cfg.Schema, owner, key), owner, key)
	if err != nil {
		m.storageFailure(w, start, "claim key", err)
		return
	}
	if !held {
		rollback()
		m.observe(OutcomeInFlight, start)
		w.Header().Set("Retry-After", retryAfterSeconds(m.cfg.RetryAfter))
		m.writeProblem(w, http.StatusConflict, ProblemInFlight, "A request with this Idempotency-Key is in progress",
			"The first request with this key has not finished yet. Retry the same request, with the same key, after the Retry-After delay.", nil)
		return
	}
	if rec != nil {
		rollback() // release the lock and the connection before writing to a possibly slow client
		m.replay(w, start, rec, fp)
		return
	}

	// First request: run the handler inside the transaction, holding its response back.
	bw := newBufferWriter(w)
	htx := pgx.Tx(managedTx{tx})
	hctx := outbox.ContextWithTx(context.WithValue(ctx, ctxKey{}, htx), htx)
	returned := false
	defer func() {
		if !returned { // panic or runtime.Goexit: the deferred rollback undoes the handler's writes
			m.observe(OutcomePanic, start)
			m.cfg.Logger.Warn("idempotency: handler did not return normally; transaction rolled back, nothing stored",
				"method", r.Method, "path", r.URL.Path)
		}
	}()
	next.ServeHTTP(bw, r.WithContext(hctx))
	returned = true
	bw.finish()

	if !m.cfg.Store(bw.status) {
		rollback()
		m.observe(OutcomeNotStored, start)
		m.send(w, bw.status, bw.header, bw.body.Bytes(), true)
		return
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), storeTimeout)
	defer cancel()
	var storedBody []byte // nil stores NULL: over the cap
	if bw.body.Len() <= m.cfg.MaxStoredResponseBytes {
		storedBody = bw.body.Bytes()
		if storedBody == nil {
			storedBody = []byte{}
		}
	}
	tag, err := tx.Exec(sctx, m.upsertSQL, owner, key, fp, bw.status, m.storedHeaders(bw.header), storedBody, m.cfg.Retention.Microseconds())
	if err == nil && tag.RowsAffected() != 1 {
		err = errors.New("a live record appeared while the key was locked")
	}
	if err != nil {
		m.storageFailure(w, start, "store response", err)
		return
	}
	if m.afterStore != nil {
		m.afterStore()
	}
	ended = true
	if err := tx.Commit(sctx); err != nil {
		// The commit may or may not have happened; either way a retry with the same key is
		// safe: it replays the stored response or runs afresh.
		m.storageFailure(w, start, "commit", err)
		return
	}
	m.observe(OutcomeStored, start)
	m.send(w, bw.status, bw.header, bw.body.Bytes(), true)
}

// claim takes the key's transaction-scoped advisory lock and then reads the key's live
// record. held is false when another transaction holds the lock.
//
// The lock and the read are two statements, pipelined in one round trip: in READ COMMITTED
// each statement takes its snapshot when it starts, so the read sees whatever the lock's
// previous holder committed. (One statement would take its snapshot before the lock is
// granted and could miss that record.)
func (m *Middleware) claim(ctx context.Context, tx pgx.Tx, lock int64, owner, key string) (held bool, rec *record, err error) {
	b := &pgx.Batch{}
	if m.cfg.WaitInFlight > 0 {
		// Wait for the holder with lock_timeout, so the waiter wakes the moment the first
		// request commits or rolls back. SET LOCAL scope: the setting is restored below
		// before the handler runs and dies with the transaction anyway.
		ms := max(m.cfg.WaitInFlight.Milliseconds(), 1) // 0 would mean "wait forever"
		var prev string
		b.Queue(`SELECT current_setting('lock_timeout')`).QueryRow(func(row pgx.Row) error { return row.Scan(&prev) })
		b.Queue(`SELECT set_config('lock_timeout', $1, true)`, strconv.FormatInt(ms, 10)+"ms")
		b.Queue(`SELECT pg_advisory_xact_lock($1)`, lock)
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
				return false, nil, nil
			}
			return false, nil, err
		}
		held = true
		b = &pgx.Batch{}
		b.Queue(`SELECT set_config('lock_timeout', $1, true)`, prev)
	} else {
		b.Queue(`SELECT pg_try_advisory_xact_lock($1)`, lock).QueryRow(func(row pgx.Row) error { return row.Scan(&held) })
	}
	var r record
	var headers map[string][]string
	found := false
	b.Queue(m.selectSQL, owner, key).Query(func(rows pgx.Rows) error {
		for rows.Next() {
			found = true
			if err := rows.Scan(&r.fingerprint, &r.status, &headers, &r.hasBody, &r.body); err != nil {
				return err
			}
		}
		return rows.Err()
	})
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return false, nil, err
	}
	if !held || !found {
		return held, nil, nil
	}
	r.headers = headers
	return true, &r, nil
}

// replay answers from a stored record.
func (m *Middleware) replay(w http.ResponseWriter, start time.Time, rec *record, fp []byte) {
	if !bytes.Equal(rec.fingerprint, fp) {
		m.observe(OutcomeMismatch, start)
		m.writeProblem(w, m.cfg.MismatchStatus, ProblemKeyReused, "Idempotency-Key is already used",
			"This key was already used with a different request (method, path, query or body). Use a new key for a new request; reuse a key only to retry the identical request.", nil)
		return
	}
	h := rec.headers.Clone()
	if h == nil {
		h = http.Header{}
	}
	h.Set(HeaderReplayed, "true")
	if !rec.hasBody {
		m.observe(OutcomeNoBody, start)
		h.Del("Content-Type") // the problem document has its own
		for k, v := range h {
			w.Header()[k] = v
		}
		m.writeProblem(w, http.StatusGone, ProblemResponseNotStored, "Stored response not available",
			"The request with this key was already executed, but its response was too large to store, so it cannot be replayed. original_status is its status; Location or Content-Location, when present, point to the result.",
			func(p *problem) { p.OriginalStatus = rec.status })
		return
	}
	m.observe(OutcomeReplayed, start)
	m.send(w, rec.status, h, rec.body, false)
}

func (m *Middleware) send(w http.ResponseWriter, status int, h http.Header, body []byte, replace bool) {
	if err := sendResponse(w, status, h, body, replace); err != nil {
		// The client is gone. The record (if any) is committed, so its retry replays.
		m.cfg.Logger.Debug("idempotency: response not delivered", "err", err)
	}
}

// storedHeaders keeps the allow-listed headers of a response.
func (m *Middleware) storedHeaders(h http.Header) map[string][]string {
	out := make(map[string][]string, len(m.cfg.StoredHeaders))
	for _, name := range m.cfg.StoredHeaders {
		if v, ok := h[name]; ok && len(v) > 0 {
			out[name] = v
		}
	}
	return out
}

func (m *Middleware) storageFailure(w http.ResponseWriter, start time.Time, step string, err error) {
	m.observe(OutcomeStorageFail, start)
	m.cfg.Logger.Error("idempotency: storage failed; nothing stored, the request's writes rolled back", "step", step, "err", err)
	w.Header().Set("Retry-After", retryAfterSeconds(m.cfg.RetryAfter))
	m.writeProblem(w, http.StatusServiceUnavailable, ProblemStorage, "Idempotency storage unavailable",
		"The request could not be completed safely and nothing was kept. Retry the same request with the same key.", nil)
}

func (m *Middleware) observe(o Outcome, start time.Time) {
	if m.cfg.Metrics != nil {
		m.cfg.Metrics.Observe(o, time.Since(start))
	}
}

// lockID maps (schema, owner, key) to the 64-bit advisory lock key. A collision between two
// different keys only makes one of them wait or get a 409; records are looked up by the exact
// (owner, key), never by this hash.
func lockID(schema, owner, key string) int64 {
	h := sha256.New()
	for _, s := range []string{"onceflow.idempotency", schema, owner, key} {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(s)))
		h.Write(n[:])
		h.Write([]byte(s))
	}
	return int64(binary.BigEndian.Uint64(h.Sum(nil)[:8]))
}
