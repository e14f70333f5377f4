package console

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"net/http"
	"strings"
)

// Credentials are what RequireCredentials accepts: a user name and password (HTTP basic
// authentication, which browsers ask for), a bearer token (for scripts and proxies), or both,
// with the Role they are given.
type Credentials struct {
	User     string
	Password string
	// Token is accepted as "Authorization: Bearer <token>", and as the password of basic
	// authentication with any user name (so a browser can use it too; that name is logged).
	Token string
	// Role is what the credential may do: Operator (the default) reads and, when the console
	// has Config.Actions, acts; Viewer only reads.
	Role Role
}

// Role is what an authenticated user may do in the console.
type Role int

const (
	// Operator reads every page and, when Config.Actions is on, uses the buttons that change
	// something.
	Operator Role = iota
	// Viewer reads every page and changes nothing: the buttons are not shown, and a POST is
	// refused, whatever Config.Actions says.
	Viewer
)

type roleKey struct{}

// ContextWithRole returns ctx carrying the role of the authenticated user (for a console
// mounted behind a service's own authentication). Without one, a user is an Operator.
func ContextWithRole(ctx context.Context, r Role) context.Context {
	return context.WithValue(ctx, roleKey{}, r)
}

func roleOf(r *http.Request) Role {
	role, _ := r.Context().Value(roleKey{}).(Role)
	return role
}

// RequireCredentials returns next behind a check of creds: a request without a credential
// that matches one of them gets 401 and reaches nothing. The name it authenticated (the
// basic-auth user, or "token") is put in the request's context for the action log and the
// audit trail (ContextWithUser), with the credential's Role (ContextWithRole).
func RequireCredentials(next http.Handler, c Credentials, more ...Credentials) (http.Handler, error) {
	all := append([]Credentials{c}, more...)
	for _, c := range all {
		if (c.User == "" || c.Password == "") && c.Token == "" {
			return nil, errors.New("console: RequireCredentials needs a user and a password, or a token")
		}
		if (c.User == "") != (c.Password == "") {
			return nil, errors.New("console: RequireCredentials needs both a user and a password, or neither")
		}
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
		name, role := "", Viewer
		for _, c := range all {
			if auth := r.Header.Get("Authorization"); strings.HasPrefix(auth, "Bearer ") {
				if eq(strings.TrimPrefix(auth, "Bearer "), c.Token) {
					name = "token"
				}
			} else if u, p, ok := r.BasicAuth(); ok {
				switch {
				case eq(u, c.User) && eq(p, c.Password):
					name = u
				case eq(p, c.Token):
					name = u
					if name == "" {
						name = "token"
					}
				}
			}
			if name != "" {
				role = c.Role
				break
			}
		}
		if name == "" {
			w.Header().Set("WWW-Authenticate", `Basic realm="onceflow console", charset="UTF-8"`)
			w.Header().Set("Cache-Control", "no-store")
			http.Error(w, "401 unauthorized: this console needs a credential", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r.WithContext(ContextWithRole(ContextWithUser(r.Context(), name), role)))
	}), nil
}
