package pgsql

import (
	"net/url"
	"regexp"
	"strings"
)

// redacted replaces every password RedactDSN and RedactError find.
const redacted = "xxxxx"

// minLiteralSecret is the shortest password RedactError also replaces where it appears on
// its own, outside a connection string: replacing a one- or two-letter password everywhere
// would garble the message while hiding little.
const minLiteralSecret = 3

var (
	// urlDSN matches a connection URL inside text: scheme, "://" and everything up to the
	// next white space or quote that ends it in a message.
	urlDSN = regexp.MustCompile("[a-zA-Z][a-zA-Z0-9+.-]*://[^\\s`\"']+")
	// keywordPassword matches password (or sslpassword) in libpq's keyword/value form, with
	// its value quoted (backslash escapes) or bare.
	keywordPassword = regexp.MustCompile(`(?i)\b((?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'?|[^\s'][^\s]*)`)
)

// RedactDSN returns the PostgreSQL connection string with every password it holds replaced by
// "xxxxx": the URL's userinfo password, password and sslpassword query parameters, and
// password=/sslpassword= in the keyword/value form. Use it wherever a connection string is
// shown (flag defaults, logs, errors). A malformed URL may be masked more than necessary,
// never less.
func RedactDSN(dsn string) string {
	// URLs and the text between them are masked by their own rules: a URL's query has
	// password=... too, but ends it at '&', not at white space.
	var b strings.Builder
	last := 0
	for _, span := range urlDSN.FindAllStringIndex(dsn, -1) {
		// Punctuation that ends a sentence or closes a parenthesis around the URL is text,
		// as in "(default postgres://...)".
		end := span[1]
		for end > span[0] && strings.IndexByte(")]},;.", dsn[end-1]) >= 0 {
			end--
		}
		b.WriteString(redactKeywords(dsn[last:span[0]]))
		b.WriteString(redactURL(dsn[span[0]:end]))
		last = end
	}
	b.WriteString(redactKeywords(dsn[last:]))
	return b.String()
}

// alreadyRedacted matches a bare keyword value that is the mask itself followed by the
// punctuation text puts around a connection string, so masking twice changes nothing.
var alreadyRedacted = regexp.MustCompile(`^` + redacted + `[)\]},;:.` + "`" + `"]*$`)

// redactKeywords masks password= and sslpassword= values of the keyword/value form.
func redactKeywords(s string) string {
	return keywordPassword.ReplaceAllStringFunc(s, func(m string) string {
		sub := keywordPassword.FindStringSubmatch(m)
		if alreadyRedacted.MatchString(sub[2]) {
			return m
		}
		return sub[1] + redacted
	})
}

// redactURL masks the passwords of one connection URL.
func redactURL(s string) string {
	masked, _ := maskURL(s)
	return masked
}

// maskURL returns the URL with its passwords masked, and the passwords it masked.
func maskURL(s string) (masked string, secrets []string) {
	scheme, rest, ok := strings.Cut(s, "://")
	if !ok {
		return s, nil
	}
	// The authority ends at the first '/', '?' or '#'; its userinfo at the last '@' in it.
	// When no '@' is in the authority but one follows, the password itself may hold one of
	// those delimiters (a malformed URL): then mask up to the last '@' before any query.
	authority := rest
	if i := strings.IndexAny(rest, "/?#"); i >= 0 {
		authority = rest[:i]
	}
	at := strings.LastIndexByte(authority, '@')
	if at < 0 && len(authority) < len(rest) && strings.IndexByte(authority, ':') >= 0 {
		if i := strings.LastIndexByte(rest, '@'); i >= 0 && !strings.ContainsAny(rest[:i], "?#") {
			at = i
		}
	}
	var b strings.Builder
	b.WriteString(scheme + "://")
	if at >= 0 {
		user, password, hasPassword := strings.Cut(rest[:at], ":")
		b.WriteString(user)
		if hasPassword {
			b.WriteString(":" + redacted)
			secrets = append(secrets, password)
		}
		rest = rest[at:]
	}
	path, query, hasQuery := strings.Cut(rest, "?")
	b.WriteString(path)
	if !hasQuery {
		return b.String(), secrets
	}
	b.WriteByte('?')
	query, fragment, hasFragment := strings.Cut(query, "#")
	for i, param := range strings.Split(query, "&") {
		if i > 0 {
			b.WriteByte('&')
		}
		key, value, hasValue := strings.Cut(param, "=")
		if k, err := url.QueryUnescape(key); hasValue && err == nil && isPasswordKey(k) {
			param = key + "=" + redacted
			secrets = append(secrets, value)
		}
		b.WriteString(param)
	}
	if hasFragment {
		b.WriteString("#" + fragment)
	}
	return b.String(), secrets
}

func isPasswordKey(k string) bool {
	k = strings.ToLower(k)
	return k == "password" || k == "sslpassword"
}

// dsnPasswords returns the passwords in dsn, as written and decoded, for Redact.
func dsnPasswords(dsn string) []string {
	var out []string
	add := func(s string) {
		if s == "" {
			return
		}
		out = append(out, s)
		if d, err := url.QueryUnescape(s); err == nil && d != s {
			out = append(out, d)
		}
	}
	for _, u := range urlDSN.FindAllString(dsn, -1) {
		_, secrets := maskURL(u)
		for _, s := range secrets {
			add(s)
		}
	}
	for _, m := range keywordPassword.FindAllStringSubmatch(dsn, -1) {
		v := m[2]
		if strings.HasPrefix(v, "'") {
			v = strings.TrimSuffix(strings.TrimPrefix(v, "'"), "'")
			v = strings.NewReplacer(`\'`, `'`, `\\`, `\`).Replace(v)
		}
		add(v)
	}
	return out
}

// RedactError returns err with every password of dsn masked in its message — where a
// connection string appears in it (any connection string, not only dsn) and, for passwords
// of three characters or more, wherever the password itself appears, as written or
// URL-decoded. errors.Is and errors.As still see err. Use it on errors of parsing or
// connecting with a connection string: pgx masks what it recognises, but a malformed string
// or a server message can still carry the password.
func RedactError(err error, dsn string) error {
	if err == nil {
		return nil
	}
	msg := Redact(err.Error(), dsn)
	if msg == err.Error() {
		return err
	}
	return &redactedError{msg: msg, err: err}
}

// Redact masks the passwords of dsn in text, as RedactError does for an error's message.
func Redact(text, dsn string) string {
	// The literal passwords first: masking the connection strings first could leave a piece
	// of one (e.g. a closing parenthesis) that no longer matches the whole.
	for _, pw := range dsnPasswords(dsn) {
		if len(pw) >= minLiteralSecret {
			text = strings.ReplaceAll(text, pw, redacted)
		}
	}
	return RedactDSN(text)
}

type redactedError struct {
	msg string
	err error
}

func (e *redactedError) Error() string { return e.msg }
func (e *redactedError) Unwrap() error { return e.err }
