package embedded

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// A synchronous standby has every acknowledged commit when it is promoted, and a client on the
// multi-host URL reaches whichever server accepts writes.
func TestStandbyPromotion(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	primary, err := StartPostgres(ctx, PostgresOptions{CrashSafe: true, MaxConnections: 20, Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	defer primary.Stop()
	standby, err := primary.StartStandby(ctx, StandbyOptions{Name: "s1", Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	defer standby.Stop()
	if err := primary.SetSynchronousStandby(ctx, "s1"); err != nil {
		t.Fatal(err)
	}
	url := MultiHostURL(primary, standby)
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `CREATE TABLE t (n int); INSERT INTO t SELECT generate_series(1, 100)`); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)

	if err := primary.Halt(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := pgx.Connect(ctx, url); err == nil {
		t.Fatal("connected to a read-write server while the primary is down and the standby not promoted")
	}
	if err := standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	conn, err = pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var n int
	var port int
	if err := conn.QueryRow(ctx, `SELECT count(*), current_setting('port')::int FROM t`).Scan(&n, &port); err != nil {
		t.Fatal(err)
	}
	if n != 100 || port != standby.Port() {
		t.Fatalf("after promotion: %d rows on port %d, want 100 on the standby's %d", n, port, standby.Port())
	}
}
