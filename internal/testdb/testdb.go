// Package testdb gives each test its own migrated schema on a real PostgreSQL.
//
// With DATABASE_URL set, tests use that server. Otherwise the first test that asks starts a
// throwaway cluster from the installed PostgreSQL binaries, shared by every test of the test
// process and removed when Main returns. Each New call creates a fresh schema, so tests can
// run in parallel without seeing each other's rows.
package testdb

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/embedded"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/migrations"
)

var (
	once    sync.Once
	server  *embedded.Postgres
	baseURL string
	initErr error
)

// Main runs the package's tests, stops the embedded cluster if one was started, checks that
// no goroutine leaked (testutil.Run) and exits. Use it from TestMain:
// func TestMain(m *testing.M) { testdb.Main(m) }.
func Main(m *testing.M) {
	os.Exit(testutil.Run(m, stopServer))
}

// stopServer stops the embedded cluster, if one was started. The check for leaked goroutines
// runs after it, so the per-test pools (closed in each test's Cleanup) are the only database
// clients that could still be running then.
func stopServer() {
	if server != nil {
		if err := server.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "testdb:", err)
		}
	}
}

// URL returns the connection string of the test server, starting it on first use.
func URL(t testing.TB) string {
	t.Helper()
	once.Do(func() {
		if u := os.Getenv("DATABASE_URL"); u != "" {
			baseURL = u
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		server, initErr = embedded.StartPostgres(ctx, embedded.PostgresOptions{CrashSafe: true})
		if initErr == nil {
			baseURL = server.URL()
		}
	})
	if initErr != nil {
		t.Fatalf("testdb: no PostgreSQL for tests: %v", initErr)
	}
	return baseURL
}

// DB is one test's isolated schema.
type DB struct {
	// Pool connects with an empty search_path: every table must be named with its schema
	// (Table, or the configured Schema in library code), so SQL that forgets the schema fails
	// with "relation does not exist" instead of finding the table by luck.
	Pool *pgxpool.Pool
	// Schema holds the onceflow tables for this test (migrations applied).
	Schema string
	// URL is the server's connection string (without the search_path), for child processes.
	URL string
}

// New creates a fresh schema with every migration applied and returns a pool bound to it.
// The schema is dropped and the pool closed when the test ends.
func New(t testing.TB) *DB {
	t.Helper()
	db := NewEmpty(t)
	if _, err := migrations.Up(context.Background(), db.Pool, migrations.Options{Schema: db.Schema}); err != nil {
		t.Fatalf("testdb: migrate schema %s: %v", db.Schema, err)
	}
	return db
}

// NewEmpty is New without migrations: the schema name is reserved and dropped at the end, but
// nothing is created. For tests of the migrations themselves.
func NewEmpty(t testing.TB) *DB {
	t.Helper()
	return newEmptyAt(t, URL(t))
}

// NewServer starts a PostgreSQL cluster of the test's own — for tests that halt or restart
// the server (embedded.Postgres.Halt, Resume, Restart), which must not disturb the package's
// other tests — and returns it with a fresh migrated schema on it, like New. The cluster is
// stopped and removed when the test ends. It starts one even when DATABASE_URL names a
// server: a test must not restart a server it shares.
func NewServer(t testing.TB) (*embedded.Postgres, *DB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// CrashSafe: a halt is a crash of the server process, and with synchronous_commit off it
	// loses the commits of the last few hundred milliseconds that it had already
	// acknowledged (they were still in its WAL buffers), which a test of restarts would
	// mistake for lost effects.
	srv, err := embedded.StartPostgres(ctx, embedded.PostgresOptions{CrashSafe: true})
	if err != nil {
		t.Fatalf("testdb: start a PostgreSQL of the test's own: %v", err)
	}
	t.Cleanup(func() {
		if err := srv.Stop(); err != nil {
			t.Logf("testdb: %v", err)
		}
	})
	db := newEmptyAt(t, srv.URL())
	if _, err := migrations.Up(ctx, db.Pool, migrations.Options{Schema: db.Schema}); err != nil {
		t.Fatalf("testdb: migrate schema %s: %v", db.Schema, err)
	}
	return srv, db
}

func newEmptyAt(t testing.TB, url string) *DB {
	t.Helper()
	schema := "t_" + randomHex(6)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatalf("testdb: parse DATABASE_URL: %v", err)
	}
	// An empty search_path, not the test's schema: library SQL must qualify every table with
	// its configured schema, and an unqualified name that would have resolved to this schema
	// (and passed by luck) now fails the test.
	cfg.ConnConfig.RuntimeParams["search_path"] = ""
	cfg.MaxConns = 16
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("testdb: connect: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgsql.Ident(schema)+" CASCADE"); err != nil {
			t.Logf("testdb: drop schema %s: %v", schema, err)
		}
		pool.Close()
	})
	return &DB{Pool: pool, Schema: schema, URL: url}
}

// Table returns name qualified with the test's schema, both quoted, for a test's own SQL
// (the pool's search_path is empty, so an unqualified name resolves to nothing).
func (db *DB) Table(name string) string { return pgsql.Table(db.Schema, name) }

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}
