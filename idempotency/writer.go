package idempotency

import (
	"bytes"
	"fmt"
	"net/http"
	"time"
)

// bufferWriter holds the handler's whole response (status, headers, body) in memory: nothing
// may reach the client before the transaction that stores it has committed, because a client
// that saw a response whose record then rolled back would retry into a second execution.
//
// Flush is accepted and does nothing: the response goes out in one piece after the commit.
// Hijack is not offered (a hijacked connection cannot be replayed), and neither is Unwrap, so
// http.ResponseController cannot reach past the buffer to the real connection; only the read
// and write deadlines are passed through.
type bufferWriter struct {
	under  http.ResponseWriter
	header http.Header
	status int // 0 until WriteHeader or the first Write
	body   bytes.Buffer
}

func newBufferWriter(w http.ResponseWriter) *bufferWriter {
	// Start from the headers outer middleware already set (CORS, request ids), so the handler
	// sees and may change them exactly as it would on the real writer.
	return &bufferWriter{under: w, header: w.Header().Clone()}
}

// Header implements http.ResponseWriter.
func (b *bufferWriter) Header() http.Header { return b.header }

// WriteHeader implements http.ResponseWriter. Informational (1xx) statuses are dropped: they
// cannot be held back without defeating their purpose, and they are not part of the result.
// A second call is ignored, as net/http does.
func (b *bufferWriter) WriteHeader(code int) {
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", code)) // same contract as net/http
	}
	if b.status != 0 || (code >= 100 && code < 200) {
		return
	}
	b.status = code
}

// Write implements http.ResponseWriter.
func (b *bufferWriter) Write(p []byte) (int, error) {
	if b.status == 0 {
		b.status = http.StatusOK
	}
	return b.body.Write(p)
}

// Flush implements http.Flusher and does nothing: see the type's comment.
func (b *bufferWriter) Flush() {}

// FlushError is Flush for http.ResponseController.
func (b *bufferWriter) FlushError() error { return nil }

// SetReadDeadline lets http.ResponseController extend the request body's read deadline.
func (b *bufferWriter) SetReadDeadline(t time.Time) error {
	return http.NewResponseController(b.under).SetReadDeadline(t)
}

// SetWriteDeadline lets http.ResponseController extend the response's write deadline, which
// matters for a slow handler: the buffered response is written after it returns.
func (b *bufferWriter) SetWriteDeadline(t time.Time) error {
	return http.NewResponseController(b.under).SetWriteDeadline(t)
}

// finish settles the status and Content-Type the way net/http would have on the first
// write, so what is stored, what the first caller gets and what a replay sends agree.
func (b *bufferWriter) finish() {
	if b.status == 0 {
		b.status = http.StatusOK
	}
	if _, set := b.header["Content-Type"]; !set && b.body.Len() > 0 && bodyAllowed(b.status) {
		b.header.Set("Content-Type", http.DetectContentType(b.body.Bytes()))
	}
}

// bodyAllowed reports whether a status may carry a body (RFC 9110: not 1xx, 204, 304).
func bodyAllowed(status int) bool {
	return status >= 200 && status != http.StatusNoContent && status != http.StatusNotModified
}

// sendResponse writes a complete response to w. The headers in h replace the writer's own,
// except that headers h does not mention are removed only when replace is set (the
// handler's response: it saw the outer headers and may have deleted some) and kept otherwise
// (a replay: headers of outer middleware stay).
func sendResponse(w http.ResponseWriter, status int, h http.Header, body []byte, replace bool) error {
	dst := w.Header()
	if replace {
		for k := range dst {
			if _, ok := h[k]; !ok {
				delete(dst, k)
			}
		}
	}
	for k, v := range h {
		dst[k] = append([]string(nil), v...)
	}
	w.WriteHeader(status)
	if len(body) == 0 || !bodyAllowed(status) {
		return nil
	}
	_, err := w.Write(body)
	return err
}
