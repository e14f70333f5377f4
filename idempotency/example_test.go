package idempotency_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
)

// A POST handler made safe to retry: the order insert and the stored response commit
// together, a retry gets the stored response, and a reused key with another body is refused.
func ExampleNew() {
	db, done := exampleDB() // a pool and a schema migrated with migrations.Up
	defer done()
	ctx := context.Background()
	db.Pool.Exec(ctx, `CREATE TABLE `+db.Table("orders")+` (id bigserial PRIMARY KEY, item text)`)

	mw, err := idempotency.New(idempotency.Config{
		Pool:   db.Pool,
		Schema: db.Schema,
		// Authentication ran before: the owner scopes the keys.
		Owner: func(r *http.Request) (string, error) { return r.Header.Get("X-User"), nil },
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	createOrder := func(w http.ResponseWriter, r *http.Request) {
		item, _ := io.ReadAll(r.Body)
		var id int64
		// outbox.MustTx returns the request's transaction: the insert commits with the response.
		err := outbox.MustTx(r.Context()).QueryRow(r.Context(),
			`INSERT INTO `+db.Table("orders")+` (item) VALUES ($1) RETURNING id`, item).Scan(&id)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError) // 5xx: rolled back, not stored
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

	var orders int
	db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Table("orders")).Scan(&orders)
	fmt.Println("orders:", orders)
	// Output:
	// 201  {"id":1}
	// 201 true {"id":1}
	// 422  problem+json
	// 400  problem+json
	// orders: 1
}

// exampleDB gives an example its own migrated schema, like testdb.New does for a test.
func exampleDB() (*testdb.DB, func()) {
	tb := &exampleTB{}
	db := testdb.New(tb)
	return db, func() {
		for i := len(tb.cleanups) - 1; i >= 0; i-- {
			tb.cleanups[i]()
		}
	}
}

// exampleTB is the little of testing.TB that testdb needs, for use outside a test.
type exampleTB struct {
	testing.TB
	cleanups []func()
}

func (*exampleTB) Helper()                           {}
func (*exampleTB) Logf(string, ...any)               {}
func (*exampleTB) Fatalf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }
func (e *exampleTB) Cleanup(f func())                { e.cleanups = append(e.cleanups, f) }
