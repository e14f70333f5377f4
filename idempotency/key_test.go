package idempotency_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/idempotency"
)

func TestParseKey(t *testing.T) {
	long := strings.Repeat("k", idempotency.MaxKeyLength)
	tests := []struct {
		name, in, want string
		err            error
	}{
		{"sf-string", `"8e03978e-40d5-43e8-bc93-6894a57f9324"`, "8e03978e-40d5-43e8-bc93-6894a57f9324", nil},
		{"bare token", `abc-123`, "abc-123", nil},
		{"bare UUID starting with a digit", `8e03978e-40d5-43e8-bc93-6894a57f9324`, "8e03978e-40d5-43e8-bc93-6894a57f9324", nil},
		{"token with colon and slash", `*tok/x:y`, "*tok/x:y", nil},
		{"surrounding spaces", "  \"a b\" \t", "a b", nil},
		{"escapes", `"a\"b\\c"`, `a"b\c`, nil},
		{"space inside string", `"order 42"`, "order 42", nil},
		{"parameters ignored", `"k";a;b=?0;c="x";d=tok;e=:aGk=:;f=1.5;g=-3; h=12`, "k", nil},
		{"max length", `"` + long + `"`, long, nil},
		{"max length bare", long, long, nil},

		{"empty", ``, "", idempotency.ErrKeyEmpty},
		{"spaces only", `   `, "", idempotency.ErrKeyEmpty},
		{"empty string", `""`, "", idempotency.ErrKeyEmpty},
		{"too long", `"` + long + `k"`, "", idempotency.ErrKeyTooLong},
		{"too long bare", long + "k", "", idempotency.ErrKeyTooLong},
		{"list of strings", `"a", "b"`, "", idempotency.ErrKeyList},
		{"list of tokens", `a,b`, "", idempotency.ErrKeyList},
		{"unterminated", `"abc`, "", idempotency.ErrKeyMalformed},
		{"control character", "\"a\x01b\"", "", idempotency.ErrKeyMalformed},
		{"bad escape", `"a\qb"`, "", idempotency.ErrKeyMalformed},
		{"lone backslash", `"a\`, "", idempotency.ErrKeyMalformed},
		{"non-ASCII", `"clé"`, "", idempotency.ErrKeyMalformed},
		{"byte sequence", `:aGk=:`, "", idempotency.ErrKeyMalformed},
		{"boolean", `?1`, "", idempotency.ErrKeyMalformed},
		{"inner list", `("a" "b")`, "", idempotency.ErrKeyMalformed},
		{"trailing garbage", `"a" b`, "", idempotency.ErrKeyMalformed},
		{"two tokens", `abc def`, "", idempotency.ErrKeyMalformed},
		{"empty parameter", `"k";`, "", idempotency.ErrKeyMalformed},
		{"upper-case parameter", `"k";A=1`, "", idempotency.ErrKeyMalformed},
		{"parameter without value", `"k";a=`, "", idempotency.ErrKeyMalformed},
		{"bad boolean parameter", `"k";a=?2`, "", idempotency.ErrKeyMalformed},
		{"bad decimal parameter", `"k";a=1.`, "", idempotency.ErrKeyMalformed},
		{"unterminated byte parameter", `"k";a=:aGk`, "", idempotency.ErrKeyMalformed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := idempotency.ParseKey(tt.in)
			if tt.err != nil {
				if !errors.Is(err, tt.err) {
					t.Fatalf("ParseKey(%q) = %q, %v; want error %v", tt.in, got, err, tt.err)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("ParseKey(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
			}
		})
	}
}

func TestFormatKey(t *testing.T) {
	for _, key := range []string{"a", `a"b\c`, "order 42", strings.Repeat("x", idempotency.MaxKeyLength)} {
		f, err := idempotency.FormatKey(key)
		if err != nil {
			t.Fatalf("FormatKey(%q): %v", key, err)
		}
		back, err := idempotency.ParseKey(f)
		if err != nil || back != key {
			t.Fatalf("ParseKey(FormatKey(%q)=%q) = %q, %v", key, f, back, err)
		}
	}
	for _, key := range []string{"", "é", "a\nb", strings.Repeat("x", idempotency.MaxKeyLength+1)} {
		if f, err := idempotency.FormatKey(key); err == nil {
			t.Errorf("FormatKey(%q) = %q; want an error", key, f)
		}
	}
}

// checkKey asserts what every accepted key must be: 1 to 255 printable ASCII characters.
func checkKey(t *testing.T, in, key string) {
	t.Helper()
	if len(key) == 0 || len(key) > idempotency.MaxKeyLength {
		t.Fatalf("ParseKey(%q) accepted a key of length %d", in, len(key))
	}
	for i := 0; i < len(key); i++ {
		if key[i] < 0x20 || key[i] > 0x7e {
			t.Fatalf("ParseKey(%q) accepted byte 0x%02x", in, key[i])
		}
	}
}

// FuzzParseKey: any input either fails or yields a valid key that survives
// FormatKey -> ParseKey unchanged.
func FuzzParseKey(f *testing.F) {
	for _, s := range []string{`"abc"`, `abc`, `"a\"b"`, `"a", "b"`, `""`, `"k";a=1;b="x"`, `:aGk=:`, `8e03978e-40d5`, `"\`, `"k";a=1.234`, `?0`, `(a)`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		key, err := idempotency.ParseKey(in)
		if err != nil {
			return
		}
		checkKey(t, in, key)
		formatted, err := idempotency.FormatKey(key)
		if err != nil {
			t.Fatalf("FormatKey(%q) of an accepted key: %v", key, err)
		}
		back, err := idempotency.ParseKey(formatted)
		if err != nil || back != key {
			t.Fatalf("round trip of %q via %q = %q, %v", key, formatted, back, err)
		}
	})
}

// FuzzFormatKey: every key FormatKey accepts parses back to itself.
func FuzzFormatKey(f *testing.F) {
	for _, s := range []string{"abc", `a"b\c`, " ", "é", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, key string) {
		formatted, err := idempotency.FormatKey(key)
		if err != nil {
			return
		}
		back, err := idempotency.ParseKey(formatted)
		if err != nil {
			t.Fatalf("ParseKey(FormatKey(%q) = %q): %v", key, formatted, err)
		}
		// Surrounding spaces are part of a quoted key and must survive.
		if back != key {
			t.Fatalf("round trip of %q via %q = %q", key, formatted, back)
		}
		checkKey(t, formatted, back)
	})
}
