package pgbouncertest_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgbouncertest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

// TestQueryExecModesThroughTransactionPooling backs the pgx settings docs/relay.md gives
// for PgBouncer in transaction mode: which of pgx's query exec modes survive concurrent
// clients through it (statements alone and in transactions), and which also carry onceflow's
// own statements (outbox.WriteTx and saga.StartTx in one business transaction).
//
//   - cache_statement (pgx's default) names its prepared statements; PgBouncer before 1.21
//     (Debian 12 ships 1.18), or without max_prepared_statements, lands them on server
//     connections that lack or already have them: "prepared statement ... does not exist /
//     already exists".
//   - describe_exec describes on one round trip and executes on the next, which PgBouncer may
//     send to another server connection outside a transaction: "unnamed prepared statement
//     does not exist" (a transaction keeps its server connection, so onceflow's writes pass).
//   - exec and simple_protocol work for plain statements but encode parameters without
//     asking the server their types, and onceflow passes JSON as bytes and maps (saga data,
//     steps, trace): saga.StartTx fails.
//   - cache_describe works for everything: the one onceflow documents.
func TestQueryExecModesThroughTransactionPooling(t *testing.T) {
	t.Parallel()
	version, err := pgbouncertest.Version()
	if err != nil {
		t.Fatal(err)
	}
	db := testdb.New(t)
	b := pgbouncertest.Start(t, pgbouncertest.Options{PoolSize: 3})
	t.Logf("%s, pool_mode = transaction, 3 server connections", version)
	def := saga.MustDefine("modes", 1, []*saga.StepDef[map[string]string]{
		saga.Step[map[string]string]("one").Send("modes.one", func(d map[string]string) (any, error) { return d, nil }),
	})
	writer, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	// PgBouncer keeps pgx's named statements in transaction mode from 1.21 when
	// max_prepared_statements is set, and sets it by default (200) from 1.22.
	oldBouncer := before122(version)

	for _, tc := range []struct {
		mode          pgx.QueryExecMode
		plain, onceFl bool // plain statements work; onceflow's work
	}{
		{pgx.QueryExecModeCacheStatement, !oldBouncer, !oldBouncer},
		{pgx.QueryExecModeDescribeExec, false, true}, // in a transaction the server connection stays
		{pgx.QueryExecModeExec, true, false},
		{pgx.QueryExecModeSimpleProtocol, true, false},
		{pgx.QueryExecModeCacheDescribe, true, true},
	} {
		t.Run(strings.ReplaceAll(tc.mode.String(), " ", "_"), func(t *testing.T) {
			ctx := context.Background()
			pool := b.Pool(t, db, 8, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = tc.mode })
			plainErr := plainLoad(ctx, pool)
			if (plainErr == nil) != tc.plain {
				t.Errorf("plain statements: err = %v, want working = %v", plainErr, tc.plain)
			}
			onceErr := concurrently(func(i int) error {
				return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					if err := writer.WriteTx(ctx, tx, "modes.events", outbox.NewMessage([]byte(`{}`))); err != nil {
						return err
					}
					_, err := saga.StartTx(ctx, tx, def, map[string]string{"n": strconv.Itoa(i)}, saga.WithWriter(writer))
					return err
				})
			})
			if (onceErr == nil) != tc.onceFl {
				t.Errorf("outbox.WriteTx + saga.StartTx: err = %v, want working = %v", onceErr, tc.onceFl)
			}
			t.Logf("plain: %v; onceflow: %v", plainErr, onceErr)
		})
	}
}

// plainLoad runs parameterised statements from 8 goroutines, alone and in transactions, and
// returns their errors.
func plainLoad(ctx context.Context, pool *pgxpool.Pool) error {
	return concurrently(func(i int) error {
		var n int
		if err := pool.QueryRow(ctx, fmt.Sprintf("SELECT $1::int + %d", i%10), i).Scan(&n); err != nil {
			return err
		}
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return tx.QueryRow(ctx, fmt.Sprintf("SELECT $1::int + %d", i%7), i).Scan(&n)
		})
	})
}

// concurrently runs f 50 times in each of 8 goroutines (so that clients meet on PgBouncer's
// server connections), each stopping at its first error, and returns the errors.
func concurrently(f func(i int) error) error {
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs error
	)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 50 {
				if err := f(i); err != nil {
					mu.Lock()
					errs = errors.Join(errs, err)
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	return errs
}

// before122 reports whether `pgbouncer --version`'s line names a version before 1.22, the
// first that keeps protocol-level prepared statements in transaction mode by default.
func before122(version string) bool {
	var major, minor int
	if _, err := fmt.Sscanf(version, "PgBouncer %d.%d", &major, &minor); err != nil {
		return true
	}
	return major < 1 || (major == 1 && minor < 22)
}

// TestMigrateThroughPgBouncer: migrations.Up applies every step through PgBouncer in
// transaction mode (with cache_describe), twice at once as two starting services would, and a
// third run finds nothing to do: its lock is transaction-scoped (pg_advisory_xact_lock), so
// no session state is left on a server connection another client then gets.
func TestMigrateThroughPgBouncer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewEmpty(t)
	b := pgbouncertest.Start(t, pgbouncertest.Options{PoolSize: 3})
	pool := b.Pool(t, db, 4, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe })
	opts := migrations.Options{Schema: db.Schema}
	errs := make(chan error, 2)
	for range 2 {
		go func() { _, err := migrations.Up(ctx, pool, opts); errs <- err }()
	}
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	applied, err := migrations.Up(ctx, pool, opts)
	if err != nil || len(applied) != 0 {
		t.Fatalf("a third Up applied %d steps (%v), want none", len(applied), err)
	}
	if err := migrations.Validate(ctx, pool, opts); err != nil {
		t.Fatal(err)
	}
}
