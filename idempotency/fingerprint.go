package idempotency

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"mime"
	"strings"
)

// fingerprintVersion is hashed first, so a future change of the algorithm makes old records
// mismatch instead of silently comparing different things.
const fingerprintVersion = 1

// fingerprint is SHA-256 over the method, the route path, the raw query and SHA-256 of the
// body, each length-prefixed so no two different requests share an encoding.
func fingerprint(method, route, rawQuery string, body []byte) []byte {
	bodySum := sha256.Sum256(body)
	h := sha256.New()
	h.Write([]byte{fingerprintVersion})
	for _, part := range [][]byte{[]byte(method), []byte(route), []byte(rawQuery), bodySum[:]} {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(part)))
		h.Write(n[:])
		h.Write(part)
	}
	return h.Sum(nil)
}

// isJSON reports whether a Content-Type names JSON: application/json or any */*+json.
func isJSON(contentType string) bool {
	mt, _, err := mime.ParseMediaType(contentType)
	if err != nil {
		return false
	}
	return mt == "application/json" || strings.HasSuffix(mt, "+json")
}

// canonicalJSON re-encodes one JSON value with object keys sorted and no insignificant
// whitespace. Numbers keep their literal text (1.0 and 1 differ); string escapes are
// normalised (\u0041 equals A); for a duplicated object key the last value wins. ok is false
// when body is not exactly one JSON value, or when decoding it would lose characters (invalid
// UTF-8, lone surrogate escapes); the caller then fingerprints the raw bytes.
func canonicalJSON(body []byte) (out []byte, ok bool) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, false
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, false // trailing data: not one JSON value
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, false
	}
	out = bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
	// The decoder turns invalid UTF-8 and lone surrogate escapes into U+FFFD, so different
	// bodies would share one canonical form; fingerprint such bodies by their raw bytes.
	if bytes.Contains(out, []byte("\uFFFD")) || bytes.Contains(out, []byte(`\ufffd`)) {
		return nil, false
	}
	return out, true
}
