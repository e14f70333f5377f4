package main

// late_lookup: what the relay's late-commit lookup costs with each structure that can serve
// it, measured on one outbox carrying all of them, so every figure comes from the same table
// at the same moment.

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgsql"
)

// lateVariant is one way of finding the rows a reference snapshot did not see.
type lateVariant struct {
	name     string
	settings string // planner settings, as the relay sets them for this lookup
	sql      string // $1 cursor, $2 ref xmax, $3 ref in-progress list
}

// benchLateLookup: an outbox of 200,000 rows, then 1,200,000, then the same after every row was
// deleted (not vacuumed: the table a drain leaves behind), with the b-tree on tx (migration
// 0012) and migration 0007's BRIN index on tx, summarized up to its last complete range (the
// state the relay kept it in) — as 0007's relay ran it (its generic plan goes parallel) and
// without parallel workers. The reference snapshot is taken while a transaction that wrote
// one early row is still open, and 2,000 rows are committed after it (a batch's worth of new
// writers): the lookup must find the early row and the new ones. Each variant runs 60 times,
// alternating; the figure is the median time of one lookup.
func benchLateLookup(ctx context.Context, e *env) ([]result, error) {
	pool, schema, err := e.freshSchema(ctx, "latelookup")
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	outboxT := pgsql.Table(schema, "outbox")
	if _, err := pool.Exec(ctx, `ALTER TABLE `+outboxT+` SET (autovacuum_enabled = false);
		CREATE INDEX outbox_tx_brin ON `+outboxT+` USING brin (((tx::text)::bigint)) WITH (pages_per_range = 32)`); err != nil {
		return nil, err
	}
	const btx = `(tx::text)::bigint`
	variants := []lateVariant{
		{"btree-0012", `SELECT set_config('enable_seqscan', 'off', true), set_config('enable_bitmapscan', 'off', true)`,
			`SELECT min(id) FROM (SELECT id FROM ` + outboxT + ` WHERE tx >= $2::text::xid8 AND tx < pg_snapshot_xmax(pg_current_snapshot()) AND id + 0 <= $1
				UNION ALL SELECT id FROM ` + outboxT + ` WHERE tx = ANY($3::text[]::xid8[]) AND id + 0 <= $1 OFFSET 0) late`},
		{"brin-0007-serial", `SELECT set_config('enable_seqscan', 'off', true), set_config('max_parallel_workers_per_gather', '0', true)`,
			`SELECT min(id) FROM (SELECT id FROM ` + outboxT + ` WHERE (` + btx + ` >= $2::text::bigint AND ` + btx + ` < (pg_snapshot_xmax(pg_current_snapshot())::text)::bigint
				OR ` + btx + ` = ANY($3::text[]::bigint[])) AND id + 0 <= $1 OFFSET 0) late`},
		{"brin-0007", `SELECT set_config('enable_seqscan', 'off', true)`,
			`SELECT min(id) FROM (SELECT id FROM ` + outboxT + ` WHERE (` + btx + ` >= $2::text::bigint AND ` + btx + ` < (pg_snapshot_xmax(pg_current_snapshot())::text)::bigint
				OR ` + btx + ` = ANY($3::text[]::bigint[])) AND id + 0 <= $1 OFFSET 0) late`},
	}
	keys := keysWhere(50, func(int) bool { return true })
	var out []result
	measure := func(label string) error {
		// The late row: written early, committed after the reference snapshot.
		late, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = late.Rollback(ctx) }()
		if err := fillOutbox(ctx, late, schema, "late", keys, 1, benchPayloadSQL); err != nil {
			return err
		}
		var ref string
		if err := pool.QueryRow(ctx, `SELECT pg_current_snapshot()::text`).Scan(&ref); err != nil {
			return err
		}
		if err := fillOutbox(ctx, pool, schema, "late", keys, 2000, benchPayloadSQL); err != nil {
			return err
		}
		if _, err := pool.Exec(ctx, `SELECT brin_summarize_new_values($1::regclass)`, pgsql.Table(schema, "outbox_tx_brin")); err != nil {
			return err
		}
		var pos int64
		if err := pool.QueryRow(ctx, `SELECT coalesce(max(id), 0) FROM `+outboxT).Scan(&pos); err != nil {
			return err
		}
		if err := late.Commit(ctx); err != nil {
			return err
		}
		xmax, xip := splitSnap(ref)
		times := map[string][]float64{}
		found := map[string]int64{}
		for range 60 {
			for _, v := range variants {
				t0 := time.Now()
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, v.settings); err != nil {
						return err
					}
					var low *int64
					if err := tx.QueryRow(ctx, v.sql, pos, xmax, xip).Scan(&low); err != nil {
						return err
					}
					if low != nil {
						found[v.name] = *low
					}
					return nil
				})
				if err != nil {
					return fmt.Errorf("%s: %w", v.name, err)
				}
				times[v.name] = append(times[v.name], ms(time.Since(t0)))
			}
		}
		for _, v := range variants {
			if found[v.name] != found[variants[0].name] {
				return fmt.Errorf("%s found late row %d, %s found %d", v.name, found[v.name], variants[0].name, found[variants[0].name])
			}
			fmt.Fprintf(os.Stderr, "  late_lookup %-10s %-14s median %.3f ms\n", v.name, label, median(times[v.name]))
			out = append(out, result{Scenario: "late_lookup", System: v.name + "-" + label, Value: median(times[v.name]), Unit: "ms", Versus: "-"})
		}
		return nil
	}
	if err := fillOutbox(ctx, pool, schema, "fill", keys, 200_000, benchPayloadSQL); err != nil {
		return nil, err
	}
	if err := measure("200k"); err != nil {
		return nil, err
	}
	if err := fillOutbox(ctx, pool, schema, "fill", keys, 1_000_000, benchPayloadSQL); err != nil {
		return nil, err
	}
	if err := measure("1.2M"); err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, `DELETE FROM `+outboxT); err != nil {
		return nil, err
	}
	if err := measure("drained"); err != nil {
		return nil, err
	}
	return out, nil
}

// splitSnap returns the xmax and in-progress list of a pg_snapshot's text form.
func splitSnap(snap string) (xmax string, xip []string) {
	parts := strings.SplitN(snap, ":", 3)
	if len(parts) != 3 {
		return "0", []string{}
	}
	xip = []string{}
	if parts[2] != "" {
		xip = strings.Split(parts[2], ",")
	}
	return parts[1], xip
}
