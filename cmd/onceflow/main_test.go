package main

import (
	"context"
	"testing"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/migrations"
)

func TestMain(m *testing.M) { testdb.Main(m) }

func TestMigrateCommand(t *testing.T) {
	ctx := context.Background()
	db := testdb.NewEmpty(t)
	args := []string{"--database-url", db.URL, "--schema", db.Schema}
	if code := run(ctx, append([]string{"migrate", "up"}, args...)); code != 0 {
		t.Fatalf("migrate up exited %d", code)
	}
	if code := run(ctx, append([]string{"migrate", "up"}, args...)); code != 0 {
		t.Fatalf("second migrate up exited %d", code)
	}
	st, err := migrations.Statuses(ctx, db.Pool, migrations.Options{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range st {
		if s.AppliedAt == nil {
			t.Fatalf("step %d pending after migrate up", s.Version)
		}
	}
	if code := run(ctx, append([]string{"migrate", "status"}, args...)); code != 0 {
		t.Fatalf("migrate status exited %d", code)
	}
	if code := run(ctx, []string{"migrate", "up", "--database-url", db.URL, "--schema", "Bad-Name"}); code != 1 {
		t.Fatalf("bad schema exited %d, want 1", code)
	}
	if code := run(ctx, []string{"migrate", "sideways"}); code != 2 {
		t.Fatalf("unknown action exited %d, want 2", code)
	}
	if code := run(ctx, []string{"nope"}); code != 2 {
		t.Fatalf("unknown command exited %d, want 2", code)
	}
}
