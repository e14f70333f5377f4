package idempotency_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/audit"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testdb"
)

// An operator finds a key's stored response (body cut at the limit given), lists an owner's
// keys page by page, and deletes a record: the next request with the key runs as a first
// one, and the audit trail has the deletion. Keys are scoped per owner throughout.
func TestAdmin(t *testing.T) {
	t.Parallel()
	ctx := audit.WithActor(context.Background(), "ops")
	db := testdb.New(t)
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("idempotency_record")+` (owner, idem_key, fingerprint, status, headers, body, expires_at) VALUES
		('orders-api', 'key-1', '\x0102', 201, '{"Content-Type": ["application/json"]}', '{"order":"o-1"}', now() + interval '1 day'),
		('orders-api', 'key-2', '\x03', 200, '{}', NULL, now() + interval '1 day'),
		('orders-api', 'key-3', '\x04', 200, '{}', 'x', now() + interval '1 day'),
		('billing-api', 'key-1', '\x05', 500, '{}', 'other owner', now() + interval '1 day')`); err != nil {
		t.Fatal(err)
	}
	a, err := idempotency.NewAdmin(db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := a.Find(ctx, db.Pool, "orders-api", "key-1", 8)
	if err != nil || rec.Status != 201 || string(rec.Body) != `{"order"` || !rec.Stored || rec.Headers["Content-Type"][0] != "application/json" {
		t.Fatalf("find: %+v, %v", rec, err)
	}
	if rec, err := a.Find(ctx, db.Pool, "orders-api", "key-2", 8); err != nil || rec.Stored {
		t.Fatalf("a record whose response was not stored: %+v, %v", rec, err)
	}
	if _, err := a.Find(ctx, db.Pool, "orders-api", "nope", 8); !errors.Is(err, idempotency.ErrNoRecord) {
		t.Fatalf("find an unknown key: %v", err)
	}
	if _, err := a.Find(ctx, db.Pool, "", "key-1", 8); err == nil {
		t.Fatal("find without an owner")
	}
	page, err := a.List(ctx, db.Pool, "orders-api", "", 2)
	if err != nil || len(page) != 2 || page[0].Key != "key-1" || page[1].Key != "key-2" {
		t.Fatalf("first page: %+v, %v", page, err)
	}
	if page, err = a.List(ctx, db.Pool, "orders-api", page[1].Key, 2); err != nil || len(page) != 1 || page[0].Key != "key-3" {
		t.Fatalf("second page: %+v, %v", page, err)
	}
	if _, err := a.List(ctx, db.Pool, "orders-api", "", 0); err == nil {
		t.Fatal("list with limit 0")
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return a.DeleteTx(ctx, tx, "orders-api", "key-1") }); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Find(ctx, db.Pool, "orders-api", "key-1", 8); !errors.Is(err, idempotency.ErrNoRecord) {
		t.Fatalf("the deleted record is found: %v", err)
	}
	if _, err := a.Find(ctx, db.Pool, "billing-api", "key-1", 8); err != nil {
		t.Fatalf("another owner's record of the same key was touched: %v", err)
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return a.DeleteTx(ctx, tx, "orders-api", "key-1") }); !errors.Is(err, idempotency.ErrNoRecord) {
		t.Fatalf("deleting it again: %v", err)
	}
	es, err := audit.List(ctx, db.Pool, db.Schema, audit.Filter{Target: "orders-api key-1"})
	if err != nil || len(es) != 1 || es[0].Action != audit.IdempotencyDelete || es[0].Actor != "ops" {
		t.Fatalf("audit trail: %+v, %v", es, err)
	}
}

// Expired counts what the cleaner would delete now, capped, and the cleaner then deletes
// exactly that many.
func TestAdminExpired(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("idempotency_record")+` (owner, idem_key, fingerprint, status, headers, expires_at)
		SELECT 'orders-api', 'old-' || g, '\x01'::bytea, 200, '{}'::jsonb, now() - interval '1 hour' FROM generate_series(1, 5) g
		UNION ALL SELECT 'orders-api', 'new-' || g, '\x01'::bytea, 200, '{}'::jsonb, now() + interval '1 hour' FROM generate_series(1, 3) g`); err != nil {
		t.Fatal(err)
	}
	a, err := idempotency.NewAdmin(db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := a.Expired(ctx, db.Pool, 100); err != nil || n != 5 {
		t.Fatalf("expired: %d, %v", n, err)
	}
	if n, err := a.Expired(ctx, db.Pool, 3); err != nil || n != 3 {
		t.Fatalf("expired, capped at 3: %d, %v", n, err)
	}
	if _, err := a.Expired(ctx, db.Pool, 0); err == nil {
		t.Fatal("a cap of 0 was accepted")
	}
	c, err := idempotency.NewCleaner(idempotency.CleanerConfig{Pool: db.Pool, Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := c.Clean(ctx); err != nil || n != 5 {
		t.Fatalf("the cleaner deleted %d, %v; Expired said 5", n, err)
	}
}
