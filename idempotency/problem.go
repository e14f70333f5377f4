package idempotency

import (
	"encoding/json"
	"math"
	"net/http"
	"strconv"
	"time"
)

// Problem type names, appended to Config.ProblemBase to form the RFC 9457 "type" URI. Each
// is a section of docs/http-idempotency.md.
const (
	ProblemKeyMissing        = "key-missing"         // 400: a route that requires the key got none
	ProblemKeyInvalid        = "key-invalid"         // 400: malformed, empty, too long, a list, or repeated
	ProblemKeyReused         = "key-reused"          // 422 (or 409): same key, different request
	ProblemInFlight          = "request-in-flight"   // 409 + Retry-After: the first request is still running
	ProblemBodyTooLarge      = "body-too-large"      // 413: request body above MaxBodyBytes
	ProblemResponseNotStored = "response-not-stored" // 410: the first response was above the storage cap
	ProblemNoOwner           = "owner-unknown"       // 401: Owner returned ErrNoOwner
	ProblemStorage           = "storage-unavailable" // 503 + Retry-After (500 for Owner failures)
)

// problem is an RFC 9457 problem detail. Failures that have no idempotency meaning (a body
// that cannot be read, an Owner error) use the type "about:blank".
type problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
	// OriginalStatus is set on response-not-stored: the status the first response had.
	OriginalStatus int `json:"original_status,omitempty"`
}

func (m *Middleware) writeProblem(w http.ResponseWriter, status int, typ, title, detail string, extra func(*problem)) {
	p := problem{Type: "about:blank", Title: title, Status: status, Detail: detail}
	if typ != "" {
		p.Type = m.cfg.ProblemBase + typ
	}
	if extra != nil {
		extra(&p)
	}
	body, _ := json.Marshal(p) // plain strings and ints: cannot fail
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Content-Language", "en")
	h.Set("Cache-Control", "no-store")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body) // a client that went away needs no problem document
}

// retryAfterSeconds renders d as a Retry-After delay: whole seconds, rounded up, at least 1.
func retryAfterSeconds(d time.Duration) string {
	s := int64(math.Ceil(d.Seconds()))
	if s < 1 {
		s = 1
	}
	return strconv.FormatInt(s, 10)
}
