package platform

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"
)

// Run runs every fn until ctx ends or one of them returns an error; then it cancels the
// others, waits for them, and returns the first error (nil after a clean shutdown).
func Run(ctx context.Context, fns ...func(context.Context) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg    sync.WaitGroup
		once  sync.Once
		first error
	)
	for _, fn := range fns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := fn(ctx); err != nil && ctx.Err() == nil {
				once.Do(func() { first = err })
			}
			cancel() // one part ending ends the service: a half-running service is worse
		}()
	}
	wg.Wait()
	return first
}

// Serve serves h on addr until ctx ends, then shuts the server down, letting requests in
// flight finish for up to 5 s.
func Serve(ctx context.Context, addr string, h http.Handler, log *slog.Logger) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	log.Info("listening", "addr", ln.Addr().String())
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err = srv.Shutdown(sctx)
	if serveErr := <-done; !errors.Is(serveErr, http.ErrServerClosed) && err == nil {
		err = serveErr
	}
	return err
}

// HandleOps adds the operational endpoints to mux: GET /healthz (200 once the service runs)
// and GET /debug/counters (the counters as a JSON object, for dashboards and `make demo`).
func HandleOps(mux *http.ServeMux, counters func() map[string]int64) {
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /debug/counters", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(counters())
	})
}

// Problem writes an RFC 9457 problem+json response. typ is a short name, made into a URI
// under the example's API docs; fields adds members such as a list of invalid fields.
func Problem(w http.ResponseWriter, status int, typ, detail string, fields map[string]any) {
	body := map[string]any{
		"type":   "https://github.com/onceflow/onceflow/tree/main/examples#" + typ,
		"title":  http.StatusText(status),
		"status": status,
		"detail": detail,
	}
	for k, v := range fields {
		body[k] = v
	}
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(body)
}

// WriteJSON writes v as a JSON response with status.
func WriteJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
