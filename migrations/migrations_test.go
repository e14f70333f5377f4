package migrations_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/migrations"
)

func TestMain(m *testing.M) { testdb.Main(m) }

func TestUpTwiceIsNoop(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewEmpty(t)
	opts := migrations.Options{Schema: db.Schema}
	first, err := migrations.Up(ctx, db.Pool, opts)
	if err != nil {
		t.Fatal(err)
	}
	if len(first) != len(migrations.All()) || len(first) == 0 {
		t.Fatalf("first run applied %d of %d", len(first), len(migrations.All()))
	}
	second, err := migrations.Up(ctx, db.Pool, opts)
	if err != nil {
		t.Fatal(err)
	}
	if len(second) != 0 {
		t.Fatalf("second run applied %d steps, want 0", len(second))
	}
	statuses, err := migrations.Statuses(ctx, db.Pool, opts)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range statuses {
		if s.AppliedAt == nil {
			t.Fatalf("step %d pending after Up", s.Version)
		}
	}
	for _, table := range []string{"outbox", "processed_event", "idempotency_record"} {
		var ok bool
		if err := db.Pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", db.Schema+"."+table).Scan(&ok); err != nil || !ok {
			t.Fatalf("table %s missing (err %v)", table, err)
		}
	}
}

func TestConcurrentUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewEmpty(t)
	opts := migrations.Options{Schema: db.Schema}
	const runners = 4
	var wg sync.WaitGroup
	applied := make([]int, runners)
	errs := make([]error, runners)
	for i := range runners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ms, err := migrations.Up(ctx, db.Pool, opts)
			applied[i], errs[i] = len(ms), err
		}()
	}
	wg.Wait()
	total := 0
	for i := range runners {
		if errs[i] != nil {
			t.Fatalf("runner %d: %v", i, errs[i])
		}
		total += applied[i]
	}
	if total != len(migrations.All()) {
		t.Fatalf("runners applied %d steps in total, want each of %d once", total, len(migrations.All()))
	}
	var rows int
	if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM schema_migration").Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != len(migrations.All()) {
		t.Fatalf("version table has %d rows", rows)
	}
}

func TestBadSchemaRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewEmpty(t)
	for _, bad := range []string{"Onceflow", "1abc", "a-b", `x"; DROP SCHEMA public; --`, strings.Repeat("a", 64), "has space"} {
		_, err := migrations.Up(ctx, db.Pool, migrations.Options{Schema: bad})
		if err == nil || !strings.Contains(err.Error(), "invalid schema name") {
			t.Errorf("schema %q: err = %v", bad, err)
		}
		if _, err := migrations.Print(migrations.Options{Schema: bad}); err == nil {
			t.Errorf("Print accepted schema %q", bad)
		}
	}
	var n int
	if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_namespace WHERE nspname NOT LIKE 'pg_%' AND nspname NOT IN ('public','information_schema') AND nspname NOT LIKE 't\\_%'").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("%d unexpected schemas created", n)
	}
}

func TestPrintAppliesCleanly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewEmpty(t)
	sql, err := migrations.Print(migrations.Options{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(sql, "{{schema}}") {
		t.Fatal("printed SQL still has the schema token")
	}
	if _, err := db.Pool.Exec(ctx, sql); err != nil {
		t.Fatalf("printed SQL fails: %v", err)
	}
	// A later Up sees the printed steps as applied.
	applied, err := migrations.Up(ctx, db.Pool, migrations.Options{Schema: db.Schema})
	if err != nil || len(applied) != 0 {
		t.Fatalf("Up after Print applied %d (err %v), want 0", len(applied), err)
	}
}
