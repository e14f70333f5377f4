package embedded

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// A cluster whose owner died without Stop is stopped and removed by the next start.
func TestOrphanedClusterIsReaped(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	orphan, err := StartPostgres(ctx, PostgresOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer orphan.Stop()
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(orphan.Dir(), ownerFile), []byte(strconv.Itoa(dead.Process.Pid)), 0o644); err != nil {
		t.Fatal(err)
	}

	next, err := StartPostgres(ctx, PostgresOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer next.Stop()
	if _, err := os.Stat(orphan.Dir()); !os.IsNotExist(err) {
		t.Fatalf("orphaned cluster folder still exists (stat err %v)", err)
	}
	if conn, err := pgx.Connect(ctx, orphan.URL()); err == nil {
		conn.Close(ctx)
		t.Fatal("orphaned cluster still accepts connections")
	}
	// A live owner's cluster is left alone.
	if _, err := os.Stat(next.Dir()); err != nil {
		t.Fatalf("the new cluster's folder is missing: %v", err)
	}
}
