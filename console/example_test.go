package console_test

import (
	"net/http"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/console"
)

// Mount the console under /ops/ of a service's mux, behind the service's own check of who is
// an operator; the name it returns is logged with every action.
func ExampleNew() {
	var pool *pgxpool.Pool // the service's pool
	// The service's own authentication: a session, mTLS, or the header of an SSO proxy that
	// sets it and strips it from clients' requests (never a header a client can send).
	operator := func(r *http.Request) (string, bool) {
		name := r.Header.Get("X-Auth-Request-User")
		return name, name != ""
	}

	h, err := console.New(console.Config{DB: pool, Schema: "onceflow", Prefix: "/ops", Actions: true})
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/ops/", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		name, ok := operator(r)
		if !ok {
			http.Error(w, "forbidden", http.StatusForbidden)
			return
		}
		h.ServeHTTP(w, r.WithContext(console.ContextWithUser(r.Context(), name)))
	}))
}
