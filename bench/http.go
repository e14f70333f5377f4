package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/outbox"
)

// HTTP scenario shape: real HTTP on loopback, a fixed crowd of concurrent clients, every
// request with a key of its own (the common case: first attempts, not retries).
const (
	httpClients  = 16
	httpRequests = 6000 // per measured run
	httpWarmup   = 300
	httpRounds   = 5 // bare and onceflow alternate; the median round counts
)

// benchHTTP: requests/s of a POST handler that inserts one row, bare (its own transaction)
// versus behind the idempotency middleware (the middleware's transaction, which also takes the
// key's lock, looks the key up and stores the response before committing).
func benchHTTP(ctx context.Context, e *env) ([]result, error) {
	pool, schema, err := e.freshSchema(ctx, "http")
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `CREATE TABLE bench_order (id bigserial PRIMARY KEY, owner text NOT NULL, payload bytea NOT NULL)`); err != nil {
		return nil, err
	}
	insert := func(ctx context.Context, tx pgx.Tx, r *http.Request) (int64, error) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			return 0, err
		}
		var id int64
		err = tx.QueryRow(ctx, `INSERT INTO bench_order (owner, payload) VALUES ($1, $2) RETURNING id`, r.Header.Get("X-User"), body).Scan(&id)
		return id, err
	}
	respond := func(w http.ResponseWriter, id int64) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d}`, id)
	}

	bare := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		var id int64
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
			id, err = insert(ctx, tx, r)
			return err
		})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		respond(w, id)
	})
	mw, err := idempotency.New(idempotency.Config{
		Pool:   pool,
		Schema: schema,
		Owner:  func(r *http.Request) (string, error) { return r.Header.Get("X-User"), nil },
	})
	if err != nil {
		return nil, err
	}
	guarded := mw.Require(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id, err := insert(r.Context(), outbox.MustTx(r.Context()), r)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		respond(w, id)
	}))

	var keys atomic.Int64
	systems := []struct {
		name string
		h    http.Handler
	}{{"bare", bare}, {"onceflow", guarded}}
	rates := map[string][]float64{}
	for _, s := range systems {
		if _, err := loadHTTP(ctx, s.h, httpWarmup, &keys); err != nil {
			return nil, fmt.Errorf("%s warm-up: %w", s.name, err)
		}
	}
	for round := 0; round < httpRounds; round++ {
		for _, s := range systems {
			rate, err := loadHTTP(ctx, s.h, httpRequests, &keys)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", s.name, err)
			}
			rates[s.name] = append(rates[s.name], rate)
		}
	}
	// Every onceflow request stored exactly one record next to its row.
	var records, orders int64
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM idempotency_record), (SELECT count(*) FROM bench_order)`).Scan(&records, &orders); err != nil {
		return nil, err
	}
	if want := int64(httpWarmup + httpRounds*httpRequests); records != want || orders != 2*want {
		return nil, fmt.Errorf("after the runs: %d records and %d rows; want %d and %d", records, orders, want, 2*want)
	}
	e.log.Info("http bench rounds", "bare", rates["bare"], "onceflow", rates["onceflow"])
	return []result{
		{Scenario: "http", System: "bare", Value: httpMedian(rates["bare"]), Unit: "req/s", HigherIsBetter: true},
		{Scenario: "http", System: "onceflow", Value: httpMedian(rates["onceflow"]), Unit: "req/s", HigherIsBetter: true, Target: "≥ 0.70× bare"},
	}, nil
}

// loadHTTP serves h on a loopback port and sends total POSTs from httpClients concurrent
// clients, each with a fresh Idempotency-Key; it returns requests per second. Any response
// but 201 is an error.
func loadHTTP(ctx context.Context, h http.Handler, total int, keys *atomic.Int64) (float64, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(ln)
	defer srv.Close()
	client := &http.Client{
		Timeout:   30 * time.Second,
		Transport: &http.Transport{MaxIdleConnsPerHost: httpClients, MaxConnsPerHost: httpClients},
	}
	defer client.CloseIdleConnections()
	url := "http://" + ln.Addr().String() + "/orders"

	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	var next atomic.Int64
	var wg sync.WaitGroup
	errc := make(chan error, httpClients)
	start := time.Now()
	for c := 0; c < httpClients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(total) {
				req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(benchPayload))
				if err != nil {
					errc <- err
					return
				}
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("X-User", "bench-user")
				req.Header.Set(idempotency.HeaderKey, fmt.Sprintf(`"bench-%d"`, keys.Add(1)))
				res, err := client.Do(req)
				if err != nil {
					errc <- err
					return
				}
				_, _ = io.Copy(io.Discard, res.Body)
				res.Body.Close()
				if res.StatusCode != http.StatusCreated {
					errc <- fmt.Errorf("status %d", res.StatusCode)
					return
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	close(errc)
	if err := errors.Join(httpErrors(errc)...); err != nil {
		return 0, err
	}
	return float64(total) / elapsed.Seconds(), nil
}

func httpErrors(errc <-chan error) []error {
	var errs []error
	for err := range errc {
		errs = append(errs, err)
	}
	return errs
}

func httpMedian(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}
