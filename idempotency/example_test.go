package idempotency_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
)

// A POST handler made safe to retry: the order row, its OrderCreated event (in the outbox)
// and the stored response commit in one transaction; a retry gets the stored response and
// runs nothing; a reused key with another body is refused. In a service the pool comes from
// pgxpool.New on DATABASE_URL and Owner from the authentication that ran before.
func ExampleNew() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{NoKafka: true}) // a throwaway, migrated database
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	pool := env.Pool
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (id bigserial PRIMARY KEY, item text NOT NULL)`); err != nil {
		fmt.Println(err)
		return
	}

	mw, err := idempotency.New(idempotency.Config{
		Pool: pool,
		// Authentication ran before: the owner scopes the keys.
		Owner: func(r *http.Request) (string, error) { return r.Header.Get("X-User"), nil },
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	createOrder := func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		item, _ := io.ReadAll(r.Body)
		tx := outbox.MustTx(ctx) // the request's transaction: everything on it commits with the response
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO orders (item) VALUES ($1) RETURNING id`, item).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError) // 5xx: rolled back, not stored
			return
		}
		evt := outbox.SetPartitionKey(outbox.NewMessage(fmt.Appendf(nil, `{"id":%d}`, id)), fmt.Sprint(id))
		if err := outbox.WriteTx(ctx, tx, "orders.created", evt); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d}`, id)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw.Require(http.HandlerFunc(createOrder)))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	post := func(key, body string) {
		req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(body))
		req.Header.Set("X-User", "alice")
		req.Header.Set("Idempotency-Key", key)
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		if res.Header.Get("Content-Type") == "application/problem+json" {
			b = []byte("problem+json")
		}
		fmt.Println(res.StatusCode, res.Header.Get("Idempotent-Replayed"), string(b))
	}
	post(`"3f1c2a9e-5b7d-4e8f-9a01-23456789abcd"`, "book") // runs
	post(`"3f1c2a9e-5b7d-4e8f-9a01-23456789abcd"`, "book") // replayed
	post(`"3f1c2a9e-5b7d-4e8f-9a01-23456789abcd"`, "pen")  // same key, other body
	post(`""`, "pen")                                      // malformed key

	var orders, events int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&orders)
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM onceflow.outbox WHERE topic = 'orders.created'`).Scan(&events)
	fmt.Println("orders:", orders, "events:", events)
	// Output:
	// 201  {"id":1}
	// 201 true {"id":1}
	// 422  problem+json
	// 400  problem+json
	// orders: 1 events: 1
}
