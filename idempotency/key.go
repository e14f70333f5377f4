package idempotency

import (
	"errors"
	"fmt"
	"strings"
)

// HeaderKey is the request header that carries the idempotency key.
const HeaderKey = "Idempotency-Key"

// HeaderReplayed is set to "true" on every response replayed from a stored record.
const HeaderReplayed = "Idempotent-Replayed"

// MaxKeyLength is the longest key accepted, in bytes (all printable ASCII).
const MaxKeyLength = 255

// Key parsing errors. ParseKey wraps one of them with detail; all of them become a 400
// problem+json response of type "key-invalid".
var (
	ErrKeyEmpty     = errors.New("Idempotency-Key is empty")
	ErrKeyTooLong   = fmt.Errorf("Idempotency-Key is longer than %d characters", MaxKeyLength)
	ErrKeyList      = errors.New("Idempotency-Key holds a list; send exactly one key")
	ErrKeyMalformed = errors.New("Idempotency-Key is malformed")
)

// ParseKey parses one Idempotency-Key field value and returns the key.
//
// The draft defines the field as an RFC 8941 Item whose value is an sf-string
// ("8e03978e-40d5-43e8-bc93-6894a57f9324"). A bare token is accepted as well, because many
// clients send keys unquoted; as an extension to RFC 8941 a bare key may start with any tchar
// (not only a letter or "*"), so an unquoted UUID that starts with a digit is accepted too.
// Well-formed RFC 8941 parameters (";name=value") are parsed and ignored, as RFC 8941 asks of
// unknown parameters. Leading and trailing spaces are ignored.
//
// Refused: an empty value or an empty string (""), more than MaxKeyLength characters, a list
// ("a", "b"), any character outside printable ASCII, and anything else RFC 8941 does not
// parse as a String or Token (integers are tokens here; byte sequences, booleans and
// decimals that are not valid bare keys are refused).
func ParseKey(value string) (string, error) {
	p := sfParser{s: strings.Trim(value, " \t")}
	if p.s == "" {
		return "", fmt.Errorf("%w: send a quoted string such as %q", ErrKeyEmpty, `"8e03978e-40d5-43e8-bc93-6894a57f9324"`)
	}
	var key string
	var err error
	switch c := p.s[0]; {
	case c == '"':
		key, err = p.str()
	case isTchar(c):
		key = p.bareKey()
	default:
		return "", fmt.Errorf("%w: it must be a quoted string (%q) or a bare token, not something starting with %q", ErrKeyMalformed, `"key"`, string(rune(c)))
	}
	if err != nil {
		return "", err
	}
	if err := p.params(); err != nil {
		return "", err
	}
	if !p.done() {
		if p.peek() == ',' {
			return "", fmt.Errorf("%w: found %q", ErrKeyList, value)
		}
		return "", fmt.Errorf("%w: unexpected %q after the key", ErrKeyMalformed, p.s[p.i:])
	}
	if key == "" {
		return "", fmt.Errorf("%w: the quoted string holds no characters; send a unique value such as a UUID", ErrKeyEmpty)
	}
	if len(key) > MaxKeyLength {
		return "", fmt.Errorf("%w (%d)", ErrKeyTooLong, len(key))
	}
	return key, nil
}

// FormatKey returns key as an RFC 8941 sf-string, ready for the Idempotency-Key header. It
// returns an error for a key that ParseKey would refuse (empty, too long, not printable ASCII).
func FormatKey(key string) (string, error) {
	if key == "" {
		return "", ErrKeyEmpty
	}
	if len(key) > MaxKeyLength {
		return "", fmt.Errorf("%w (%d)", ErrKeyTooLong, len(key))
	}
	var b strings.Builder
	b.Grow(len(key) + 2)
	b.WriteByte('"')
	for i := 0; i < len(key); i++ {
		c := key[i]
		if c < 0x20 || c > 0x7e {
			return "", fmt.Errorf("%w: byte 0x%02x at position %d is not printable ASCII", ErrKeyMalformed, c, i)
		}
		if c == '"' || c == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(c)
	}
	b.WriteByte('"')
	return b.String(), nil
}

// sfParser is a minimal RFC 8941 Item parser: just what the Idempotency-Key field needs.
type sfParser struct {
	s string
	i int
}

func (p *sfParser) done() bool { return p.i >= len(p.s) }
func (p *sfParser) peek() byte {
	if p.done() {
		return 0
	}
	return p.s[p.i]
}

// str parses an sf-string (RFC 8941 §4.2.5) starting at the opening quote.
func (p *sfParser) str() (string, error) {
	p.i++ // opening quote
	var b strings.Builder
	for !p.done() {
		c := p.s[p.i]
		p.i++
		switch {
		case c == '\\':
			if p.done() {
				return "", fmt.Errorf("%w: the string ends with a lone backslash", ErrKeyMalformed)
			}
			n := p.s[p.i]
			p.i++
			if n != '"' && n != '\\' {
				return "", fmt.Errorf("%w: only \\\" and \\\\ may be escaped in a quoted string, found \\%c", ErrKeyMalformed, n)
			}
			b.WriteByte(n)
		case c == '"':
			return b.String(), nil
		case c < 0x20 || c > 0x7e:
			return "", fmt.Errorf("%w: byte 0x%02x is not printable ASCII", ErrKeyMalformed, c)
		default:
			if b.Len() > MaxKeyLength {
				// Keep scanning for syntax, but stop growing the buffer.
				continue
			}
			b.WriteByte(c)
		}
	}
	return "", fmt.Errorf("%w: the quoted string is not closed", ErrKeyMalformed)
}

// bareKey parses a token, extended to start with any tchar: 1*( tchar / ":" / "/" ).
func (p *sfParser) bareKey() string {
	start := p.i
	for !p.done() && (isTchar(p.s[p.i]) || p.s[p.i] == ':' || p.s[p.i] == '/') {
		p.i++
	}
	return p.s[start:p.i]
}

// params parses RFC 8941 parameters (§4.2.3.2) and discards them.
func (p *sfParser) params() error {
	for p.peek() == ';' {
		p.i++
		for p.peek() == ' ' {
			p.i++
		}
		if c := p.peek(); !(isLCAlpha(c) || c == '*') {
			return fmt.Errorf("%w: a parameter name must start with a lower-case letter or *", ErrKeyMalformed)
		}
		for !p.done() {
			c := p.s[p.i]
			if !(isLCAlpha(c) || isDigit(c) || c == '_' || c == '-' || c == '.' || c == '*') {
				break
			}
			p.i++
		}
		if p.peek() == '=' {
			p.i++
			if err := p.bareItem(); err != nil {
				return err
			}
		}
	}
	// Trailing spaces were trimmed before parsing; anything left is the caller's to judge.
	return nil
}

// bareItem parses and discards one RFC 8941 bare item (a parameter value).
func (p *sfParser) bareItem() error {
	c := p.peek()
	switch {
	case c == '"':
		_, err := p.str()
		return err
	case isAlpha(c) || c == '*':
		p.i++
		for !p.done() && (isTchar(p.s[p.i]) || p.s[p.i] == ':' || p.s[p.i] == '/') {
			p.i++
		}
		return nil
	case c == '-' || isDigit(c):
		return p.number()
	case c == ':':
		p.i++
		for !p.done() && p.s[p.i] != ':' {
			if !isBase64(p.s[p.i]) {
				return fmt.Errorf("%w: invalid byte sequence in a parameter", ErrKeyMalformed)
			}
			p.i++
		}
		if p.done() {
			return fmt.Errorf("%w: unterminated byte sequence in a parameter", ErrKeyMalformed)
		}
		p.i++
		return nil
	case c == '?':
		p.i++
		if b := p.peek(); b != '0' && b != '1' {
			return fmt.Errorf("%w: a boolean parameter must be ?0 or ?1", ErrKeyMalformed)
		}
		p.i++
		return nil
	default:
		return fmt.Errorf("%w: invalid parameter value", ErrKeyMalformed)
	}
}

// number parses an sf-integer or sf-decimal (RFC 8941 §4.2.4).
func (p *sfParser) number() error {
	if p.peek() == '-' {
		p.i++
	}
	digits, frac, dot := 0, 0, false
	for !p.done() {
		c := p.s[p.i]
		if isDigit(c) {
			if dot {
				frac++
			} else {
				digits++
			}
		} else if c == '.' && !dot {
			dot = true
		} else {
			break
		}
		p.i++
	}
	switch {
	case digits == 0:
		return fmt.Errorf("%w: invalid number in a parameter", ErrKeyMalformed)
	case !dot && digits > 15, dot && (digits > 12 || frac == 0 || frac > 3):
		return fmt.Errorf("%w: number out of range in a parameter", ErrKeyMalformed)
	}
	return nil
}

func isDigit(c byte) bool   { return c >= '0' && c <= '9' }
func isLCAlpha(c byte) bool { return c >= 'a' && c <= 'z' }
func isAlpha(c byte) bool   { return isLCAlpha(c) || (c >= 'A' && c <= 'Z') }
func isBase64(c byte) bool  { return isAlpha(c) || isDigit(c) || c == '+' || c == '/' || c == '=' }

// isTchar reports an RFC 9110 token character.
func isTchar(c byte) bool {
	if isAlpha(c) || isDigit(c) {
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}
