package testdb

import (
	"context"
	"testing"
	"time"
)

func TestMain(m *testing.M) { Main(m) }

// A halt is a crash of the server process: NewServer's cluster must keep every commit it
// acknowledged before it (with synchronous_commit off, the last ones were still in its WAL
// buffers and were lost).
func TestNewServerHaltLosesNoAcknowledgedCommit(t *testing.T) {
	srv, db := NewServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tbl := db.Table("acked")
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE `+tbl+` (n int)`); err != nil {
		t.Fatal(err)
	}
	const n = 50
	for i := range n {
		if _, err := db.Pool.Exec(ctx, `INSERT INTO `+tbl+` VALUES ($1)`, i); err != nil {
			t.Fatal(err)
		}
	}
	if err := srv.Halt(ctx); err != nil {
		t.Fatal(err)
	}
	if err := srv.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	var got int
	// The pool's connections died with the server; the first use may get one of them.
	for attempt := 0; ; attempt++ {
		err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+tbl).Scan(&got)
		if err == nil {
			break
		}
		if attempt == 5 {
			t.Fatalf("after the restart: %v", err)
		}
	}
	if got != n {
		t.Fatalf("%d of %d acknowledged commits survived the halt", got, n)
	}
}
