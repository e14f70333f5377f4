package testdb

import (
	"context"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/embedded"
	"github.com/onceflow/onceflow/migrations"
)

// Pair is a primary and a streaming standby of the test's own, for failover tests
// (embedded.Postgres.StartStandby).
type Pair struct {
	Primary, Standby *embedded.Postgres
	// URL names both servers with target_session_attrs=read-write (embedded.MultiHostURL):
	// clients on it follow the standby's promotion by reconnecting.
	URL string
}

// StandbyName is the standby's application_name (synchronous_standby_names).
const StandbyName = "standby1"

// NewPair starts a primary (CrashSafe: synchronous_commit on) and a streaming standby made
// with pg_basebackup -R, synchronous when sync is true (synchronous_standby_names names it),
// and returns them with a fresh migrated schema whose pool connects through the multi-host
// URL. Both clusters are stopped and removed when the test ends. Like NewServer, it ignores
// DATABASE_URL: a failover must not happen to a shared server.
func NewPair(t testing.TB, sync bool) (*Pair, *DB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	primary, err := embedded.StartPostgres(ctx, embedded.PostgresOptions{CrashSafe: true, MaxConnections: 100})
	if err != nil {
		t.Fatalf("testdb: start a primary: %v", err)
	}
	t.Cleanup(func() {
		if err := primary.Stop(); err != nil {
			t.Logf("testdb: %v", err)
		}
	})
	standby, err := primary.StartStandby(ctx, embedded.StandbyOptions{Name: StandbyName})
	if err != nil {
		t.Fatalf("testdb: start a standby: %v", err)
	}
	t.Cleanup(func() {
		if err := standby.Stop(); err != nil {
			t.Logf("testdb: %v", err)
		}
	})
	if sync {
		if err := primary.SetSynchronousStandby(ctx, StandbyName); err != nil {
			t.Fatalf("testdb: make the standby synchronous: %v", err)
		}
	}
	p := &Pair{Primary: primary, Standby: standby, URL: embedded.MultiHostURL(primary, standby)}
	db := newEmptyAt(t, p.URL)
	if _, err := migrations.Up(ctx, db.Pool, migrations.Options{Schema: db.Schema}); err != nil {
		t.Fatalf("testdb: migrate schema %s: %v", db.Schema, err)
	}
	return p, db
}
