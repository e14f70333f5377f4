package console

import (
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"net/http"
	"strings"
)

// Credentials are what RequireCredentials accepts: a user name and password (HTTP basic
// authentication, which browsers ask for), a bearer token (for scripts and proxies), or both.
type Credentials struct {
	User     string
	Password string
	// Token is accepted as "Authorization: Bearer <token>", and as the password of basic
	// authentication with any user name (so a browser can use it too; that name is logged).
	Token string
}

// RequireCredentials returns next behind a check of c: a request without a matching
// credential gets 401 and reaches nothing. The name it authenticated (the basic-auth user,
// or "token") is put in the request's context for the action log (ContextWithUser).
func RequireCredentials(next http.Handler, c Credentials) (http.Handler, error) {
	if (c.User == "" || c.Password == "") && c.Token == "" {
		return nil, errors.New("console: RequireCredentials needs a user and a password, or a token")
	}
	if (c.User == "") != (c.Password == "") {
		return nil, errors.New("console: RequireCredentials needs both a user and a password, or neither")
	}
	// Compare digests: equal length whatever was sent, so the time taken says nothing about
	// the secret's length or prefix.
	eq := func(got, want string) bool {
		if want == "" {
			return false
		}
		g, w := sha256.Sum256([]byte(got)), sha256.Sum256([]byte(want))
		return subtle.ConstantTimeCompare(g[:], w[:]) == 1
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		name := ""
		if auth := r.Header.Get("Authorization"); strings.HasPrefix(auth, "Bearer ") {
			if eq(strings.TrimPrefix(auth, "Bearer "), c.Token) {
				name = "token"
			}
		} else if u, p, ok := r.BasicAuth(); ok {
			userOK := eq(u, c.User)
			switch {
			case userOK && eq(p, c.Password):
				name = u
			case eq(p, c.Token):
				name = u
				if name == "" {
					name = "token"
				}
			}
		}
		if name == "" {
			w.Header().Set("WWW-Authenticate", `Basic realm="onceflow console", charset="UTF-8"`)
			w.Header().Set("Cache-Control", "no-store")
			http.Error(w, "401 unauthorized: this console needs a credential", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r.WithContext(ContextWithUser(r.Context(), name)))
	}), nil
}
