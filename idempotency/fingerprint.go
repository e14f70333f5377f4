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
	"unicode/utf8"
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
// UTF-8, lone surrogate escapes, or U+FFFD, which cannot be told apart from those after
// decoding); the caller then fingerprints the raw bytes.
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
	// The decoder turns invalid UTF-8 and lone surrogate escapes into U+FFFD, so different
	// bodies would share one canonical form; fingerprint such bodies by their raw bytes. A
	// U+FFFD written in the body cannot be told apart from a substituted one, so it takes the
	// same path. The decoded strings are checked, not the encoded output, where the text
	// `\ufffd` after an escaped backslash (`"\\ufffd"`) would look like one.
	if hasReplacementChar(v) {
		return nil, false
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, false
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n")), true
}

// hasReplacementChar reports whether a decoded JSON value has U+FFFD in any string, object
// keys included.
func hasReplacementChar(v any) bool {
	switch v := v.(type) {
	case string:
		return strings.ContainsRune(v, utf8.RuneError)
	case []any:
		for _, e := range v {
			if hasReplacementChar(e) {
				return true
			}
		}
	case map[string]any:
		for k, e := range v {
			if strings.ContainsRune(k, utf8.RuneError) || hasReplacementChar(e) {
				return true
			}
		}
	}
	return false
}
