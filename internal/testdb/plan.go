package testdb

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// StalePlanBuffers measures what a statement costs once the table it reads has grown past the
// size it was planned at — what a service meets when pgx prepared the statement (once per
// connection) while the table was small, and no ANALYZE has invalidated the plan since.
//
// On one connection with generic plans forced, it prepares stmt (parameter types types, e.g.
// "text, text[]"), executes it once with args (SQL literals, e.g. `'c', ARRAY['k']`), runs
// grow, and returns the shared buffers the same plan touches executing args again.
func StalePlanBuffers(t testing.TB, pool *pgxpool.Pool, stmt, types, args string, grow func()) int {
	t.Helper()
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatalf("testdb: acquire: %v", err)
	}
	defer conn.Release()
	for _, q := range []string{
		`SET plan_cache_mode = force_generic_plan`,
		`PREPARE onceflow_stale_plan(` + types + `) AS ` + stmt,
		`EXECUTE onceflow_stale_plan(` + args + `)`,
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatalf("testdb: %s: %v", q, err)
		}
	}
	defer func() {
		_, _ = conn.Exec(ctx, `DEALLOCATE onceflow_stale_plan; RESET plan_cache_mode`)
	}()
	grow()
	var out []struct {
		Plan struct {
			Hit  int `json:"Shared Hit Blocks"`
			Read int `json:"Shared Read Blocks"`
		} `json:"Plan"`
	}
	var raw []byte
	if err := conn.QueryRow(ctx, `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE onceflow_stale_plan(`+args+`)`).Scan(&raw); err != nil {
		t.Fatalf("testdb: explain: %v", err)
	}
	if err := json.Unmarshal(raw, &out); err != nil || len(out) != 1 {
		t.Fatalf("testdb: read the plan %s: %v", raw, err)
	}
	return out[0].Plan.Hit + out[0].Plan.Read
}
