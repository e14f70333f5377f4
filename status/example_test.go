package status_test

import (
	"encoding/json"
	"net/http"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/status"
)

// A service serves the same report as `onceflow status --json` from a health endpoint: 200
// when all is well, 503 with the problems (each says what to do) when something is stuck.
func ExampleRead() {
	var pool *pgxpool.Pool // the service's pool
	th := status.DefaultThresholds()
	th.MaxStuckSagas = 10 // this service tolerates a few stuck sagas before paging anyone
	http.HandleFunc("GET /health/onceflow", func(w http.ResponseWriter, r *http.Request) {
		rep, err := status.Read(r.Context(), pool, "onceflow", th)
		if err != nil {
			http.Error(w, "could not look: "+err.Error(), http.StatusInternalServerError)
			return
		}
		if !rep.OK {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_ = json.NewEncoder(w).Encode(rep)
	})
}
