package onceflowtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/migrations"
)

// poolMaxConns leaves room for what a test runs at once on one pool: a relay (its claim
// connection and its LISTEN connection), an inbox router (which keeps one connection free,
// see docs/inbox.md) and HTTP handlers. pgxpool's default is 4 on a small machine.
const poolMaxConns = 16

// newDatabase creates a database on the server at serverURL, migrates it and opens a pool on
// it. drop closes the pool and drops the database.
func newDatabase(ctx context.Context, serverURL string) (db *DB, drop func() error, err error) {
	name := "onceflowtest_" + randomHex(6)
	admin, err := pgx.Connect(ctx, serverURL)
	if err != nil {
		return nil, nil, fmt.Errorf("connect to the PostgreSQL server: %w", err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgsql.Ident(name)); err != nil {
		return nil, nil, fmt.Errorf("create database %s (with DATABASE_URL, its role needs CREATEDB): %w", name, err)
	}
	dropDB := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, serverURL)
		if err != nil {
			return fmt.Errorf("drop database %s: connect: %w", name, err)
		}
		defer conn.Close(ctx)
		// FORCE: a client the test forgot to close must not keep the database alive.
		if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgsql.Ident(name)+" WITH (FORCE)"); err != nil {
			return fmt.Errorf("drop database %s: %w", name, err)
		}
		return nil
	}
	dbURL, err := withDatabase(serverURL, name)
	if err != nil {
		return nil, nil, errors.Join(err, dropDB())
	}
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		return nil, nil, errors.Join(fmt.Errorf("parse the connection string: %w", err), dropDB())
	}
	cfg.MaxConns = poolMaxConns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, nil, errors.Join(fmt.Errorf("connect to database %s: %w", name, err), dropDB())
	}
	if _, err := migrations.Up(ctx, pool, migrations.Options{}); err != nil {
		pool.Close()
		return nil, nil, errors.Join(fmt.Errorf("migrate database %s: %w", name, err), dropDB())
	}
	db = &DB{Pool: pool, Schema: pgsql.DefaultSchema, DatabaseURL: dbURL, Name: name}
	return db, func() error {
		pool.Close()
		return dropDB()
	}, nil
}

// withDatabase returns serverURL pointing at database name instead, in either of the forms
// PostgreSQL accepts: a URL (postgres://...) or keyword=value pairs.
func withDatabase(serverURL, name string) (string, error) {
	if strings.HasPrefix(serverURL, "postgres://") || strings.HasPrefix(serverURL, "postgresql://") {
		u, err := url.Parse(serverURL)
		if err != nil {
			return "", fmt.Errorf("parse the connection string: %w", pgsql.RedactError(err, serverURL))
		}
		u.Path = "/" + name
		return u.String(), nil
	}
	// In keyword=value form a later keyword overrides an earlier one.
	return strings.TrimSpace(serverURL) + " dbname=" + name, nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err) // crypto/rand does not fail on supported platforms
	}
	return hex.EncodeToString(b)
}
