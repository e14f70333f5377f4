package idempotency_test

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/outbox"
)

var endingStatements = testutil.EndingStatements

var sendVia = testutil.SendVia

// endingHandler inserts an order, on the first run of a key sends the statement of the
// request's X-Case (ignoring the error, as a careless handler would), inserts a second order
// and answers 201, which is stored.
func endingHandler(t *testing.T, cases []testutil.TxControlCase, runsPerKey map[string]int, mu *sync.Mutex) func(*testdb.DB, *atomic.Int64) http.Handler {
	return func(db *testdb.DB, runs *atomic.Int64) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			ctx := r.Context()
			key := r.Header.Get(idempotency.HeaderKey)
			mu.Lock()
			runsPerKey[key]++
			first := runsPerKey[key] == 1
			mu.Unlock()
			tx := outbox.MustTx(ctx)
			insert := func(item string) {
				if _, err := tx.Exec(ctx, `INSERT INTO `+db.Table("orders")+` (owner, item) VALUES ($1, $2)`, key, item); err != nil {
					t.Errorf("%s: insert %s: %v", key, item, err)
				}
			}
			insert("before")
			if first {
				i, _ := strconv.Atoi(r.Header.Get("X-Case"))
				c := cases[i]
				err := sendVia(ctx, tx, c.Via, c.SQL)
				if c.Via == "exec" && !errors.Is(err, outbox.ErrTxManaged) {
					t.Errorf("%s: Exec = %v; want ErrTxManaged", c.Name, err)
				}
			}
			if tx.Conn().PgConn().TxStatus() == 'T' { // else the insert would fail or run outside
				insert("after")
			}
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, "order of %s", key)
		})
	}
}

// A handler that ends the request's transaction with SQL, and even ignores the error it gets:
// the request fails with 500, nothing of the handler is kept and nothing is stored, and the
// retry runs the handler once; the next retry replays.
func TestHandlerCannotEndTheTransactionWithSQL(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	runsPerKey := map[string]int{}
	f := newFixture(t, idempotency.Config{}, endingHandler(t, endingStatements, runsPerKey, &mu))
	ordersOf := func(key string) int {
		return f.count(t, `SELECT count(*) FROM `+f.db.Table("orders")+` WHERE owner = $1`, key)
	}
	recordsOf := func(key string) int {
		return f.count(t, `SELECT count(*) FROM `+f.db.Table("idempotency_record")+` WHERE idem_key = $1`, key)
	}
	for i, c := range endingStatements {
		key := fmt.Sprintf("case-%d", i)
		r := f.send(t, "POST", "/orders", "alice", key, "book", "X-Case", strconv.Itoa(i))
		if r.status != http.StatusInternalServerError || r.header.Get("Content-Type") != "application/problem+json" || ordersOf(key) != 0 || recordsOf(key) != 0 {
			t.Errorf("%s: first request answered %d %s and kept %d orders, %d records; want 500 problem+json and nothing kept",
				c.Name, r.status, r.body, ordersOf(key), recordsOf(key))
			continue
		}
		retry := f.send(t, "POST", "/orders", "alice", key, "book", "X-Case", strconv.Itoa(i))
		again := f.send(t, "POST", "/orders", "alice", key, "book", "X-Case", strconv.Itoa(i))
		mu.Lock()
		runs := runsPerKey[key]
		mu.Unlock()
		if retry.status != http.StatusCreated || retry.replayed() || !again.replayed() || ordersOf(key) != 2 || recordsOf(key) != 1 || runs != 2 {
			t.Errorf("%s: retry %d (replayed %v), next %d (replayed %v); %d orders, %d records, %d runs; want 201, a replay, 2 orders, 1 record, 2 runs",
				c.Name, retry.status, retry.replayed(), again.status, again.replayed(), ordersOf(key), recordsOf(key), runs)
		}
	}
}

// Going around the view (tx.Conn()) cannot be refused before it runs; the middleware sees
// the ended transaction afterwards, stores nothing and answers 500. After a ROLLBACK that way
// nothing is kept and the retry runs once. After a COMMIT that way the handler's first write
// is already committed — the middleware cannot undo it, and says so in its log — so the
// retry runs the handler again.
func TestHandlerEndingTheTransactionAroundTheView(t *testing.T) {
	t.Parallel()
	cases := []testutil.TxControlCase{{Name: "ROLLBACK", Via: "conn", SQL: "ROLLBACK"}, {Name: "COMMIT", Via: "conn", SQL: "COMMIT"}}
	var mu sync.Mutex
	runsPerKey := map[string]int{}
	f := newFixture(t, idempotency.Config{}, endingHandler(t, cases, runsPerKey, &mu))
	for i, c := range cases {
		key, ordersAfterFailure, ordersAtEnd := c.Name, 0, 2
		if c.Name == "COMMIT" {
			ordersAfterFailure, ordersAtEnd = 1, 3
		}
		r := f.send(t, "POST", "/orders", "alice", key, "book", "X-Case", strconv.Itoa(i))
		orders := f.count(t, `SELECT count(*) FROM `+f.db.Table("orders")+` WHERE owner = $1`, key)
		if r.status != http.StatusInternalServerError || orders != ordersAfterFailure || f.count(t, `SELECT count(*) FROM `+f.db.Table("idempotency_record")+` WHERE idem_key = $1`, key) != 0 {
			t.Errorf("%s on the connection: %d %s, %d orders; want 500, %d orders, no record", c.Name, r.status, r.body, orders, ordersAfterFailure)
			continue
		}
		if r := f.send(t, "POST", "/orders", "alice", key, "book", "X-Case", strconv.Itoa(i)); r.status != http.StatusCreated {
			t.Errorf("%s: retry %d %s", c.Name, r.status, r.body)
		}
		if orders := f.count(t, `SELECT count(*) FROM `+f.db.Table("orders")+` WHERE owner = $1`, key); orders != ordersAtEnd {
			t.Errorf("%s: %d orders after the retry; want %d", c.Name, orders, ordersAtEnd)
		}
	}
}

// A statement failed and the handler answered 4xx anyway (a stored status): its transaction is
// aborted, so nothing can be stored; the request fails with 500 naming the cause, not with a
// storage failure that invites the same retry.
func TestHandlerIgnoringAFailedStatement(t *testing.T) {
	t.Parallel()
	var failed atomic.Bool
	f := newFixture(t, idempotency.Config{}, func(db *testdb.DB, runs *atomic.Int64) http.Handler {
		inner := orderHandler(db.Table("orders"), runs)
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if !failed.Swap(true) {
				runs.Add(1)
				ctx := r.Context()
				_, _ = outbox.MustTx(ctx).Exec(ctx, `INSERT INTO `+db.Table("orders")+` (owner, item) VALUES (NULL, 'x')`) // not null violation
				http.Error(w, "order refused", http.StatusConflict)
				return
			}
			inner(w, r)
		})
	})
	r := f.send(t, "POST", "/orders", "alice", `"k"`, "book")
	if r.status != http.StatusInternalServerError || f.records(t) != 0 {
		t.Fatalf("handler ignoring a failed statement: %d %s, %d records; want 500 and no record", r.status, r.body, f.records(t))
	}
	if r := f.send(t, "POST", "/orders", "alice", `"k"`, "book"); r.status != http.StatusCreated || f.orders(t) != 1 || f.runs.Load() != 2 {
		t.Fatalf("retry: %d, %d orders, %d runs", r.status, f.orders(t), f.runs.Load())
	}
}
