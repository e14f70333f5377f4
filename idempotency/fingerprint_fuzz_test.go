package idempotency_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/onceflow/onceflow/idempotency"
)

// FuzzCanonicalJSON checks the canonical form the fingerprint hashes when Config.CanonicalJSON
// is on. Its documented rules: object keys sorted, insignificant whitespace removed, string
// escapes normalised, the last of duplicated keys kept, number literals kept as written; a body
// that is not exactly one JSON value, or that would decode with loss (invalid UTF-8, lone
// surrogate escapes), is not canonicalised and the raw bytes are hashed instead.
//
// Properties, for any input:
//   - no panic;
//   - accepted only if the body is one valid JSON value whose decoding loses nothing;
//   - the output is valid JSON with the same value as the body (numbers compared by their
//     literal text), so two bodies share a canonical form only if they are equal JSON under
//     the rules above — a request changed in any other way gets another fingerprint;
//   - idempotence: the output is accepted and canonicalises to itself. This is also why a raw
//     body never collides with another body's canonical form: a body equal to a canonical
//     form is accepted and hashed as itself;
//   - no whitespace outside strings, and keys in sorted order (compared after decoding);
//   - every valid, lossless JSON body is accepted (otherwise reordered keys would wrongly
//     make a retry a different request).
//
// Run it with: go test -run=^$ -fuzz=FuzzCanonicalJSON -fuzztime=60s ./idempotency
func FuzzCanonicalJSON(f *testing.F) {
	for _, seed := range []string{
		`{"b":1,"a":[1,2]}`,
		" {\n \"a\" : [1, 2],\t\"b\":1 } ",
		`{"o":{"z":true,"y":null}}`,
		`{"s":"\u0041\/"}`,
		`{"s":"<&>"}`,
		`{"s":"\u003c\u0026\u003e"}`,
		`{"n":1.0}`, `{"n":1}`, `{"n":-0}`, `{"n":1e400}`, `{"n":12345678901234567890}`, `{"n":1E+2}`,
		`{"a":1,"a":2}`, `{"a":{"x":1},"a":{"y":2}}`,
		`[]`, `{}`, `null`, `true`, `"x"`, `0`, `[[[[[[[[[[]]]]]]]]]]`,
		`{"e":"\ud83d\ude00"}`, "{\"e\":\"\U0001F600\"}",
		`{"lone":"\ud800"}`, `{"lone":"\udc00x"}`,
		"{\"bad\":\"\xff\"}", "\xef\xbb\xbf{}", // invalid UTF-8; a byte-order mark
		`{"r":"\ufffd"}`, "{\"r\":\"\xef\xbf\xbd\"}", // U+FFFD in the body
		`{"t":"\\ufffd"}`, `{"t":"\\uFFFD"}`, // a backslash followed by text, not an escape
		`{"ls":"\u2028\u2029"}`, `{"ctl":"\u0000\u001f"}`,
		`{"k\u00e9":1,"ké":2}`,
		``, ` `, `{`, `{} {}`, `{"a":1} x`, `nope`, `[1,]`, `{"a" 1}`, `"\x"`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		out, ok := idempotency.CanonicalJSON(body)
		want, lossless := decodeJSON(body)
		if !ok {
			if lossless {
				t.Fatalf("valid lossless JSON refused (its raw bytes would be hashed, so reordering its keys would make a retry a different request): %q", body)
			}
			return
		}
		if !lossless {
			t.Fatalf("accepted %q as %q, but it is not one valid JSON value or its decoding loses characters", body, out)
		}
		got, ok2 := decodeJSON(out)
		if !ok2 {
			t.Fatalf("canonical form %q of %q is not valid lossless JSON", out, body)
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("canonical form changes the value:\nbody  %q -> %#v\nout   %q -> %#v", body, want, out, got)
		}
		again, ok3 := idempotency.CanonicalJSON(out)
		if !ok3 || !bytes.Equal(again, out) {
			t.Fatalf("not idempotent: %q -> %q -> %q (ok %v)", body, out, again, ok3)
		}
		checkCanonicalLayout(t, out)
	})
}

// decodeJSON decodes exactly one JSON value with numbers kept as their literal text, and
// reports whether that succeeded without loss: the body is valid UTF-8 and no string (key or
// value) came out with U+FFFD, which the decoder substitutes for lone surrogate escapes.
// A U+FFFD written in the body counts as a loss too: after decoding it cannot be told apart
// from a substitution, so the canonical form must not rely on it.
func decodeJSON(body []byte) (any, bool) {
	if !utf8.Valid(body) {
		return nil, false
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, false
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, false
	}
	return v, !hasReplacement(v)
}

func hasReplacement(v any) bool {
	switch v := v.(type) {
	case string:
		return strings.ContainsRune(v, utf8.RuneError)
	case []any:
		for _, e := range v {
			if hasReplacement(e) {
				return true
			}
		}
	case map[string]any:
		for k, e := range v {
			if strings.ContainsRune(k, utf8.RuneError) || hasReplacement(e) {
				return true
			}
		}
	}
	return false
}

// checkCanonicalLayout walks out's tokens: no whitespace between them (the encoder writes
// none, and an input's spacing must not survive), and each object's keys strictly increasing
// (sorted, no duplicates).
func checkCanonicalLayout(t *testing.T, out []byte) {
	t.Helper()
	// Whitespace outside strings: strip string contents, then look for any.
	inString, escaped := false, false
	for i, c := range out {
		switch {
		case escaped:
			escaped = false
		case inString && c == '\\':
			escaped = true
		case c == '"':
			inString = !inString
		case !inString && (c == ' ' || c == '\t' || c == '\n' || c == '\r'):
			t.Fatalf("canonical form %q has whitespace at byte %d", out, i)
		}
	}
	dec := json.NewDecoder(bytes.NewReader(out))
	dec.UseNumber()
	type frame struct {
		object  bool
		lastKey *string
		wantKey bool
	}
	var stack []frame
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			return
		}
		if err != nil {
			t.Fatalf("canonical form %q: %v", out, err)
		}
		top := len(stack) - 1
		if top >= 0 && stack[top].object && stack[top].wantKey {
			if d, ok := tok.(json.Delim); ok && d == '}' {
				stack = stack[:top]
				continue
			}
			k := tok.(string)
			if last := stack[top].lastKey; last != nil && k <= *last {
				t.Fatalf("canonical form %q: key %q after %q", out, k, *last)
			}
			stack[top].lastKey, stack[top].wantKey = &k, false
			continue
		}
		if top >= 0 && stack[top].object {
			stack[top].wantKey = true // this token is a value; a key comes next
		}
		switch tok {
		case json.Delim('{'):
			stack = append(stack, frame{object: true, wantKey: true})
		case json.Delim('['):
			stack = append(stack, frame{})
		case json.Delim('}'), json.Delim(']'):
			stack = stack[:len(stack)-1]
		}
	}
}
