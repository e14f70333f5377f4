package testdb

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/migrations"
)

// NewDatabase creates a fresh database on the test server with every migration applied to the
// default schema ("onceflow"), as `onceflow migrate up` leaves a service's database, and
// returns a pool on it with default settings: the caller's own tables go to public, and the
// package-level outbox.WriteTx finds its table. It is for Example functions, which have no
// testing.TB and should read like a service's code: it panics where New would fail a test.
// Call done to close the pool and drop the database.
func NewDatabase() (pool *pgxpool.Pool, done func()) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	base := URL(panicTB{})
	name := "example_" + randomHex(6)
	admin, err := pgx.Connect(ctx, base)
	if err != nil {
		panic(fmt.Sprintf("testdb: connect: %v", err))
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgsql.Ident(name)); err != nil {
		panic(fmt.Sprintf("testdb: create database %s: %v", name, err))
	}
	drop := func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if conn, err := pgx.Connect(ctx, base); err == nil {
			_, _ = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgsql.Ident(name)+" WITH (FORCE)")
			_ = conn.Close(ctx)
		}
	}
	cfg, err := pgxpool.ParseConfig(base)
	if err != nil {
		drop()
		panic(fmt.Sprintf("testdb: parse DATABASE_URL: %v", err))
	}
	cfg.ConnConfig.Database = name
	pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		drop()
		panic(fmt.Sprintf("testdb: connect to %s: %v", name, err))
	}
	if _, err := migrations.Up(ctx, pool, migrations.Options{}); err != nil {
		pool.Close()
		drop()
		panic(fmt.Sprintf("testdb: migrate database %s: %v", name, err))
	}
	return pool, func() {
		pool.Close()
		drop()
	}
}

// panicTB is the little of testing.TB that URL needs, outside a test.
type panicTB struct{ testing.TB }

func (panicTB) Helper() {}

func (panicTB) Fatalf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }
