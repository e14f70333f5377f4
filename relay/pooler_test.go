package relay_test

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgbouncertest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/relay"
)

// pooledExecMode is the pgx setting docs/relay.md gives for PgBouncer older than 1.21 (and
// newer ones without max_prepared_statements): no named prepared statements.
func pooledExecMode(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec }

// TestListenBehindPgBouncer: the relay's data path runs through PgBouncer; its LISTEN
//   - in transaction mode, on the pool's own route, is found deaf at start-up: the relay warns
//     with the fix (ListenConnConfig / --listen-database-url, or DisableListen), never marks
//     itself asleep (so writers send no NOTIFY) and publishes by polling;
//   - in transaction mode with ListenConnConfig on the server directly, wakes the relay at
//     once (polling is off: one poll an hour);
//   - in session mode, on the pool's route, works as on a direct connection.
func TestListenBehindPgBouncer(t *testing.T) {
	t.Parallel()
	brokers := kafkatest.Brokers(t, 1)
	run := func(t *testing.T, mode string, direct bool, poll time.Duration) (db *testdb.DB, logs *testutil.SyncBuffer, topic string, c *consumer) {
		db = testdb.New(t)
		b := pgbouncertest.Start(t, pgbouncertest.Options{PoolMode: mode, PoolSize: 5})
		pool := b.Pool(t, db, 8, pooledExecMode)
		topic = kafkatest.Topic("pooled")
		c = newConsumer(t, brokers, topic)
		logs = &testutil.SyncBuffer{}
		cfg := relay.Config{PollInterval: poll, Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))}
		if direct {
			lc, err := pgx.ParseConfig(db.URL)
			if err != nil {
				t.Fatal(err)
			}
			cfg.ListenConnConfig = lc
		}
		rec := newRecorder()
		cfg.Metrics = rec
		startRelay(t, newRelayOnPool(t, pool, db, brokers, cfg))
		rec.waitFor(t, 30*time.Second, "shards owned", func(r *recorder) bool { return r.owned > 0 })
		return db, logs, topic, c
	}
	// woken: with polling off, rows written after the relay fell asleep are published at once.
	woken := func(t *testing.T, db *testdb.DB, logs *testutil.SyncBuffer, topic string, c *consumer) {
		eventually(t, 30*time.Second, "the relay to sleep (its listener works)", func() bool { return asleep(t, db) })
		want := writeEvents(t, db, topic, 20, 4, 1)
		checkDelivery(t, want, c.waitDistinct(t, len(want), 20*time.Second))
		if s := logs.String(); s != "" {
			t.Errorf("the relay warned:\n%s", s)
		}
	}

	t.Run("transaction mode, pool's route", func(t *testing.T) {
		t.Parallel()
		db, logs, topic, c := run(t, "transaction", false, 200*time.Millisecond)
		testutil.AwaitWithin(t, 30*time.Second, "the relay's warning", func() bool { return strings.Contains(logs.String(), "LISTEN/NOTIFY does not work here") },
			logs.String)
		for _, want := range []string{"connection pooler", "ListenConnConfig", "--listen-database-url", "DisableListen", "--no-listen", "PollInterval"} {
			if !strings.Contains(logs.String(), want) {
				t.Errorf("the warning does not mention %q:\n%s", want, logs.String())
			}
		}
		want := writeEvents(t, db, topic, 20, 4, 1)
		checkDelivery(t, want, c.waitDistinct(t, len(want), 20*time.Second))
		// Idle for longer than it takes a relay to fall asleep: it never does, so writers never
		// pay for a NOTIFY nobody receives.
		deadline := time.Now().Add(time.Second)
		for time.Now().Before(deadline) {
			if asleep(t, db) {
				t.Fatal("the relay marked itself asleep although its listener receives nothing")
			}
			time.Sleep(50 * time.Millisecond)
		}
		if n := strings.Count(logs.String(), "LISTEN/NOTIFY does not work here"); n != 1 {
			t.Errorf("warned %d times, want once:\n%s", n, logs.String())
		}
	})
	t.Run("transaction mode, ListenConnConfig direct", func(t *testing.T) {
		t.Parallel()
		db, logs, topic, c := run(t, "transaction", true, time.Hour)
		woken(t, db, logs, topic, c)
	})
	t.Run("session mode, pool's route", func(t *testing.T) {
		t.Parallel()
		db, logs, topic, c := run(t, "session", false, time.Hour)
		woken(t, db, logs, topic, c)
	})
}
