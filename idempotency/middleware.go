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
//		tx := outbox.MustTx(r.Context())
//		_, err := tx.Exec(r.Context(), `INSERT INTO orders ...`)
//		...
//	}
//
// The middleware is a plain func(http.Handler) http.Handler (Handler and Require), so chi,
// echo (echo.WrapMiddleware) and gin (gin.WrapH) use it as is. The
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
	"math/rand/v2"
	"net/http"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/tracing"
	"github.com/onceflow/onceflow/outbox"
)

// errTxManaged is what Commit and Rollback return on the handler's transaction.
var errTxManaged = fmt.Errorf("%w (idempotency: it commits after storing the response; to abort the handler's writes, respond with a status that is not stored, e.g. 5xx)", outbox.ErrTxManaged)

// storeTimeout bounds storing the record and committing once the handler has returned. The
// request's own context is not used for that step: a client that hung up after the handler
// finished should still find the result stored when it retries.
const storeTimeout = 30 * time.Second

// Middleware makes covered requests that carry an Idempotency-Key run once. It is safe for
// concurrent use; build one per configuration and wrap as many handlers as needed.
type Middleware struct {
	cfg        Config
	methods    map[string]bool
	selectSQL  string
	insertSQL  string
	replaceSQL string
	// afterStore, when set (tests only), runs between replacing an expired record and the
	// commit.
	afterStore func()
	// waitSlots holds one token per request waiting for a key (WaitInFlight); its capacity
	// is MaxWaiters.
	waitSlots chan struct{}
	waitMu    sync.Mutex
	waiters   map[int64]*keyWaiters // by lock id
}

// New validates cfg, reporting every problem at once, and returns the middleware. It refuses
// a config without Pool or Owner.
func New(cfg Config) (*Middleware, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	m := &Middleware{cfg: cfg, methods: map[string]bool{}, waitSlots: make(chan struct{}, cfg.MaxWaiters), waiters: map[int64]*keyWaiters{}}
	for _, method := range cfg.Methods {
		m.methods[method] = true
	}
	table := pgsql.Table(cfg.Schema, "idempotency_record")
	// now() is the transaction's start on the database clock: expiry never depends on the
	// application servers' clocks agreeing.
	m.selectSQL = `SELECT fingerprint, status, headers, body IS NOT NULL, coalesce(body, ''), expires_at > now() FROM ` + table +
		` WHERE owner = $1 AND idem_key = $2`
	cols := ` (owner, idem_key, fingerprint, status, headers, body, created_at, expires_at)
	VALUES ($1, $2, $3, $4, $5, $6, now(), now() + $7 * interval '1 microsecond')`
	m.insertSQL = `INSERT INTO ` + table + cols
	// Only an expired record may be replaced: a zero row count means a live one appeared.
	m.replaceSQL = `INSERT INTO ` + table + ` AS r` + cols + `
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

// record is a stored response.
type record struct {
	fingerprint []byte
	status      int
	headers     http.Header
	hasBody     bool
	body        []byte
	live        bool // false: expired, counts as absent
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
		m.observe(r, OutcomeRejected, start)
		m.writeProblem(w, http.StatusBadRequest, ProblemKeyMissing, "Idempotency-Key is missing",
			"This operation requires an Idempotency-Key header: send a unique value, e.g. a random UUID as a quoted string, and reuse it only to retry this same request.", nil)
		return
	case len(values) > 1:
		m.observe(r, OutcomeRejected, start)
		m.writeProblem(w, http.StatusBadRequest, ProblemKeyInvalid, "Idempotency-Key is invalid",
			fmt.Sprintf("The request has %d Idempotency-Key header lines; send exactly one.", len(values)), nil)
		return
	}
	key, err := ParseKey(values[0])
	if err != nil {
		m.observe(r, OutcomeRejected, start)
		m.writeProblem(w, http.StatusBadRequest, ProblemKeyInvalid, "Idempotency-Key is invalid",
			err.Error()+". Send one quoted string of 1 to 255 printable ASCII characters, e.g. a random UUID.", nil)
		return
	}
	owner, err := m.cfg.Owner(r)
	if err == nil && owner == "" {
		err = fmt.Errorf("%w: Owner returned an empty owner", ErrNoOwner)
	}
	if err != nil {
		m.observe(r, OutcomeRejected, start)
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
		m.observe(r, OutcomeRejected, start)
		m.writeProblem(w, http.StatusRequestEntityTooLarge, ProblemBodyTooLarge, "Request body too large",
			fmt.Sprintf("Requests with an Idempotency-Key may carry at most %d bytes of body. Nothing was executed or stored.", m.cfg.MaxBodyBytes), nil)
		return
	}
	if err != nil {
		m.observe(r, OutcomeRejected, start)
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
	lock := lockID(m.cfg.Schema, owner, key)
	pc, tx, rec, ok := m.acquireKey(ctx, w, r, start, lock, owner, key)
	if !ok {
		return // answered: 409 in flight, or 503
	}
	// Release returns the connection to the pool, or destroys it if a transaction is still
	// open or aborted on it (a failure path), so nothing leaks into the next request.
	defer pc.Release()

	// The handler's view of tx cannot end it, and is closed once the handler is done.
	htx, viewDone := pgsql.ManagedTx(tx, errTxManaged)
	ended := false
	rollback := func() {
		_ = viewDone() // closes the view; what it reports matters only after the handler ran
		if ended {
			return
		}
		ended = true
		endTx(ctx, tx)
		m.wake(lock) // the key's lock is free: waiters of this process try again at once
	}
	defer rollback()
	if rec != nil && rec.live {
		rollback() // release the lock and the connection before writing to a possibly slow client
		m.replay(w, r, start, rec, fp)
		return
	}

	// First request (or the first since the record expired): run the handler inside the
	// transaction, holding its response back.
	bw := newBufferWriter(w)
	hctx := outbox.ContextWithTx(ctx, htx)
	returned := false
	defer func() {
		if !returned { // panic or runtime.Goexit: the deferred rollback undoes the handler's writes
			m.observe(r, OutcomePanic, start)
			m.cfg.Logger.Warn("idempotency: handler did not return normally; transaction rolled back, nothing stored",
				"method", r.Method, "path", r.URL.Path)
		}
	}()
	next.ServeHTTP(bw, r.WithContext(hctx))
	returned = true
	// The handler is done with the transaction, whatever it kept a reference to. Did it leave
	// the transaction to us? A refused COMMIT (or ROLLBACK, END, ...), a transaction ended
	// around the view, or — when its status is one we would store — an aborted transaction
	// all fail the request: nothing is stored and its writes roll back.
	viewErr := viewDone()
	bw.finish()
	store := m.cfg.Store(bw.status)
	if viewErr != nil && (store || !errors.Is(viewErr, pgsql.ErrTxAborted)) {
		rollback()
		m.txMisuse(w, r, start, viewErr)
		return
	}

	if !store {
		rollback()
		m.observe(r, OutcomeNotStored, start)
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
	args := []any{owner, key, fp, bw.status, m.storedHeaders(bw.header), storedBody, m.cfg.Window.Microseconds()}
	var err error
	if rec == nil {
		// Second (and last) round trip of our own: insert and commit, pipelined. Should the insert fail (a record written
		// without the lock: unique violation), PostgreSQL skips the COMMIT and the deferred
		// rollback undoes everything.
		b := &pgx.Batch{}
		b.Queue(m.insertSQL, args...)
		b.Queue("commit")
		err = tx.SendBatch(sctx, b).Close()
	} else {
		// Replacing an expired record: the cleaner may delete it meanwhile (it does not take
		// the lock), hence the upsert, and its row count is checked before committing.
		var tag pgconn.CommandTag
		if tag, err = tx.Exec(sctx, m.replaceSQL, args...); err == nil && tag.RowsAffected() != 1 {
			err = errors.New("a live record appeared while the key was locked (was it written without the middleware?)")
		}
		if err == nil && m.afterStore != nil {
			m.afterStore()
		}
		if err == nil {
			err = tx.Commit(sctx)
		}
	}
	if err != nil {
		// The commit may or may not have happened (a lost connection); either way a retry with
		// the same key is safe: it replays the stored response or runs afresh.
		m.storageFailure(w, r, start, "store response", err)
		return
	}
	ended = true
	m.wake(lock)
	m.observe(r, OutcomeStored, start)
	m.send(w, bw.status, bw.header, bw.body.Bytes(), true)
}

// claim opens the request transaction, takes the key's transaction-scoped advisory lock and
// reads the key's record (live or expired; rec is nil when there is none), all in one round
// trip. held is false when another transaction holds the lock. tx is nil only when the
// transaction could not be begun; otherwise the caller must end it, even when err is set.
//
// The lock dies with the transaction or the connection, so a crashed server leaves no lock
// behind. READ COMMITTED explicitly, whatever the server's default: the record is read by a
// statement that takes its snapshot after the lock statement finished, so it sees anything
// the lock's previous holder committed. (In one statement, or at REPEATABLE READ, the
// snapshot would predate the lock and could miss that record.)
func (m *Middleware) claim(ctx context.Context, pc *pgxpool.Conn, lock int64, owner, key string) (tx pgx.Tx, held bool, rec *record, err error) {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	b.Queue(`SELECT pg_try_advisory_xact_lock($1)`, lock).QueryRow(func(row pgx.Row) error { return row.Scan(&held) })
	b.Queue(m.selectSQL, owner, key).Query(func(rows pgx.Rows) error {
		for rows.Next() {
			var r record
			var headers map[string][]string
			if err := rows.Scan(&r.fingerprint, &r.status, &headers, &r.hasBody, &r.body, &r.live); err != nil {
				return err
			}
			r.headers = headers
			rec = &r
		}
		return rows.Err()
	})
	br := pc.SendBatch(ctx, b)
	tx = br.Tx()
	err = br.Close()
	if err != nil {
		if errors.Is(err, pgx.ErrTxClosed) || pc.Conn().PgConn().TxStatus() == 'I' {
			return nil, false, nil, err // BEGIN itself failed: no transaction to end
		}
		return tx, false, nil, err
	}
	return tx, held, rec, nil
}

// Polling of a waiting request (Config.WaitInFlight): the first retry comes after
// waitPollMin, each later one after twice the previous pause, at most waitPollMax, each
// jittered down by up to half so that waiters do not move in step. A request of this process
// that releases the key wakes its waiters at once.
const (
	waitPollMin = 10 * time.Millisecond
	waitPollMax = 100 * time.Millisecond
)

// acquireKey takes a pooled connection, opens the request transaction on it and takes the
// key's lock, returning the key's record (nil when there is none). When another request
// holds the key it answers 409 — at once, or, with WaitInFlight, after waiting up to that
// long for the key without holding a connection: it polls the lock in short transactions
// (try-lock, then roll back and release the connection), or is woken by the holder when that
// is a request of this process. At most MaxWaiters requests wait at once; more get 409 at
// once. ok is false when the request has been answered (409, or 503 on a storage failure);
// otherwise the caller owns pc and tx.
func (m *Middleware) acquireKey(ctx context.Context, w http.ResponseWriter, r *http.Request, start time.Time, lock int64, owner, key string) (pc *pgxpool.Conn, tx pgx.Tx, rec *record, ok bool) {
	var (
		kw       *keyWaiters // set while this request waits
		deadline time.Time
	)
	defer func() {
		if kw != nil {
			m.leave(lock, kw)
			<-m.waitSlots
		}
	}()
	for pause := waitPollMin; ; pause = min(2*pause, waitPollMax) {
		pc, err := m.cfg.Pool.Acquire(ctx)
		if err != nil {
			m.claimFailure(w, r, start, "acquire connection", err)
			return nil, nil, nil, false
		}
		tx, held, rec, err := m.claim(ctx, pc, lock, owner, key)
		switch {
		case tx == nil:
			pc.Release()
			m.claimFailure(w, r, start, "begin transaction", err)
			return nil, nil, nil, false
		case err != nil:
			endTx(ctx, tx)
			pc.Release()
			m.claimFailure(w, r, start, "claim key", err)
			return nil, nil, nil, false
		case held:
			return pc, tx, rec, true
		}
		endTx(ctx, tx) // give the connection back while the key is held elsewhere
		pc.Release()
		if m.cfg.WaitInFlight == 0 {
			m.inFlight(w, r, start)
			return nil, nil, nil, false
		}
		if kw == nil {
			select {
			case m.waitSlots <- struct{}{}:
			default: // MaxWaiters requests already wait
				m.inFlight(w, r, start)
				return nil, nil, nil, false
			}
			// Join the key's waiters, then try once more at once: a holder that finished
			// before we joined woke nobody.
			kw, deadline = m.join(lock), time.Now().Add(m.cfg.WaitInFlight)
			continue
		}
		left := time.Until(deadline)
		if left <= 0 {
			m.inFlight(w, r, start)
			return nil, nil, nil, false
		}
		timer := time.NewTimer(min(pause-rand.N(pause/2), left))
		select {
		case <-kw.ch: // the holder, in this process, is done
			m.leave(lock, kw)
			kw = m.join(lock)
		case <-timer.C:
		case <-ctx.Done(): // the client is gone
			timer.Stop()
			m.inFlight(w, r, start)
			return nil, nil, nil, false
		}
		timer.Stop()
	}
}

// keyWaiters are the requests of this process waiting for one key; ch is closed when a
// request of this process releases the key.
type keyWaiters struct {
	ch chan struct{}
	n  int
}

func (m *Middleware) join(lock int64) *keyWaiters {
	m.waitMu.Lock()
	defer m.waitMu.Unlock()
	kw := m.waiters[lock]
	if kw == nil {
		kw = &keyWaiters{ch: make(chan struct{})}
		m.waiters[lock] = kw
	}
	kw.n++
	return kw
}

func (m *Middleware) leave(lock int64, kw *keyWaiters) {
	m.waitMu.Lock()
	defer m.waitMu.Unlock()
	kw.n--
	if kw.n == 0 && m.waiters[lock] == kw {
		delete(m.waiters, lock)
	}
}

// wake tells this process's waiters of the key that it is free.
func (m *Middleware) wake(lock int64) {
	m.waitMu.Lock()
	defer m.waitMu.Unlock()
	if kw := m.waiters[lock]; kw != nil {
		close(kw.ch)
		delete(m.waiters, lock)
	}
}

// endTx rolls tx back on a context detached from the request's, so a cancelled request still
// releases its transaction (and lock) cleanly; should the rollback fail, pgx closes the
// connection, which ends the transaction too.
func endTx(ctx context.Context, tx pgx.Tx) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = tx.Rollback(rctx)
}

func (m *Middleware) inFlight(w http.ResponseWriter, r *http.Request, start time.Time) {
	m.observe(r, OutcomeInFlight, start)
	w.Header().Set("Retry-After", retryAfterSeconds(m.cfg.RetryAfter))
	m.writeProblem(w, http.StatusConflict, ProblemInFlight, "A request with this Idempotency-Key is in progress",
		"The first request with this key has not finished yet. Retry the same request, with the same key, after the Retry-After delay.", nil)
}

// replay answers from a stored record.
func (m *Middleware) replay(w http.ResponseWriter, r *http.Request, start time.Time, rec *record, fp []byte) {
	if !bytes.Equal(rec.fingerprint, fp) {
		m.observe(r, OutcomeMismatch, start)
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
		m.observe(r, OutcomeNoBody, start)
		h.Del("Content-Type") // the problem document has its own
		for k, v := range h {
			w.Header()[k] = v
		}
		m.writeProblem(w, http.StatusGone, ProblemResponseNotStored, "Stored response not available",
			"The request with this key was already executed, but its response was too large to store, so it cannot be replayed. original_status is its status; Location or Content-Location, when present, point to the result.",
			func(p *problem) { p.OriginalStatus = rec.status })
		return
	}
	m.observe(r, OutcomeReplayed, start)
	m.send(w, rec.status, h, rec.body, false)
}

func (m *Middleware) send(w http.ResponseWriter, status int, h http.Header, body []byte, replace bool) {
	if err := sendResponse(w, status, h, body, replace); err != nil {
		// The client is gone. The record (if any) is committed, so its retry replays.
		m.cfg.Logger.Debug("idempotency: response not delivered", "err", err)
	}
}

// storedHeaders keeps the allow-listed headers of a response. A header present without values
// is kept too: a nil Content-Type is how a handler tells net/http not to sniff one, and the
// replay must not gain a sniffed Content-Type the first response did not have.
func (m *Middleware) storedHeaders(h http.Header) map[string][]string {
	out := make(map[string][]string, len(m.cfg.StoredHeaders))
	for _, name := range m.cfg.StoredHeaders {
		if v, ok := h[name]; ok {
			out[name] = v
		}
	}
	return out
}

// claimFailure answers a request whose key could not be claimed: a storage failure, unless
// the request's context was cancelled, which is the client going away (the failed step is then
// just the first to notice). Only steps before the handler come here: once it has returned,
// the response is stored on a context detached from the request's, so a cancellation cannot
// fail it and a failure there is always the storage's.
func (m *Middleware) claimFailure(w http.ResponseWriter, r *http.Request, start time.Time, step string, err error) {
	if !errors.Is(r.Context().Err(), context.Canceled) {
		m.storageFailure(w, r, start, step, err)
		return
	}
	m.observe(r, OutcomeCanceled, start)
	m.cfg.Logger.Debug("idempotency: client went away before the request began; nothing ran or was stored",
		"step", step, "method", r.Method, "path", r.URL.Path, "err", err)
	// Nobody is likely to read this; should the cancellation have come from elsewhere, the
	// caller learns that a retry with the same key is safe.
	w.Header().Set("Retry-After", retryAfterSeconds(m.cfg.RetryAfter))
	m.writeProblem(w, http.StatusServiceUnavailable, "", "Request cancelled",
		"The request was cancelled before it began: nothing was executed or kept. Retry the same request with the same key.", nil)
}

func (m *Middleware) storageFailure(w http.ResponseWriter, r *http.Request, start time.Time, step string, err error) {
	m.observe(r, OutcomeStorageFail, start)
	m.cfg.Logger.Error("idempotency: storage failed; nothing stored, the request's writes rolled back", "step", step, "err", err)
	w.Header().Set("Retry-After", retryAfterSeconds(m.cfg.RetryAfter))
	m.writeProblem(w, http.StatusServiceUnavailable, ProblemStorage, "Idempotency storage unavailable",
		"The request could not be completed safely and nothing was kept. Retry the same request with the same key.", nil)
}

// txMisuse answers a request whose handler did not leave its transaction for the middleware
// to commit (see pgsql.ManagedTx); the transaction is already rolled back.
func (m *Middleware) txMisuse(w http.ResponseWriter, r *http.Request, start time.Time, err error) {
	m.observe(r, OutcomeTxMisuse, start)
	m.cfg.Logger.Error("idempotency: the handler did not leave its transaction to the middleware; nothing stored, the request fails with 500",
		"method", r.Method, "path", r.URL.Path, "err", err)
	m.writeProblem(w, http.StatusInternalServerError, "", "Internal Server Error",
		"The request failed on the server and nothing was stored for this Idempotency-Key.", nil)
}

// observe reports the outcome to Metrics and, as the onceflow.idempotency.outcome attribute,
// to the request's span (an otelhttp server span, say), so a slow or refused request's trace
// says what the middleware did. Without a recording span this costs nothing.
func (m *Middleware) observe(r *http.Request, o Outcome, start time.Time) {
	m.cfg.Metrics.Observe(o, time.Since(start))
	if span := trace.SpanFromContext(r.Context()); span.IsRecording() {
		span.SetAttributes(tracing.IdempotencyOutcome.String(string(o)))
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
