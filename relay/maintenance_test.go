package relay_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// pacedWriters commits one event per transaction from `writers` goroutines, each at most one
// transaction per `every`, until the returned stop is called; written counts the committed
// events. Paced, so the write rate is the same whatever the relay does, and a relay that
// keeps up delivers at that rate.
func pacedWriters(t *testing.T, db *testdb.DB, topic string, writers int, every time.Duration) (written *atomic.Int64, stop func()) {
	t.Helper()
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	written = &atomic.Int64{}
	errc := make(chan error, writers)
	var wg sync.WaitGroup
	for g := range writers {
		wg.Go(func() {
			tick := time.NewTicker(every)
			defer tick.Stop()
			for i := 0; ; i++ {
				select {
				case <-ctx.Done():
					return
				case <-tick.C:
				}
				m := outbox.SetPartitionKey(outbox.NewMessage(fmt.Appendf(nil, "w%d/%d", g, i)), fmt.Sprintf("w%d", g))
				if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return w.WriteTx(ctx, tx, topic, m) }); err != nil {
					if ctx.Err() == nil {
						errc <- err
					}
					return
				}
				written.Add(1)
			}
		})
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			wg.Wait()
			close(errc)
			for err := range errc {
				t.Errorf("writer: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return written, stop
}

// TestDeliveryContinuesWhileOutboxHeldForMaintenance: a session holds SHARE UPDATE EXCLUSIVE
// on the outbox for 30 s — the lock a manual VACUUM or ANALYZE, an anti-wraparound autovacuum
// and CREATE INDEX CONCURRENTLY hold — while writers keep committing. The relay's claims,
// publishes and deletes take no lock that conflicts with it, so delivery keeps up with the
// writes (at least 0.95 of their rate over the 30 s) and the backlog stays at a few batches. (With migration 0007's BRIN summary on the
// claim path, every claim waited for this lock until the statement timeout: delivery fell to
// a few events per second and the backlog grew for as long as the lock was held.)
func TestDeliveryContinuesWhileOutboxHeldForMaintenance(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 4)
	topic := kafkatest.Topic("maint")
	c := newConsumer(t, brokers, topic)
	// A statement timeout well inside the lock's 30 s, so a claim that did wait for the lock
	// would show as a stall of seconds, not hide in a window's average.
	startRelay(t, newKafkaRelay(t, db, brokers, relay.Config{StatementTimeout: 5 * time.Second}))
	written, stopWriters := pacedWriters(t, db, topic, 8, 10*time.Millisecond) // up to 800 events/s

	// rate measures delivery over a window: the sleep is the measurement.
	rate := func(window time.Duration) (delivered, wrote float64, maxBacklog int) {
		d0, w0 := c.distinct(), written.Load()
		end := time.Now().Add(window)
		for time.Now().Before(end) {
			maxBacklog = max(maxBacklog, outboxCount(t, db))
			time.Sleep(250 * time.Millisecond)
		}
		secs := window.Seconds()
		return float64(c.distinct()-d0) / secs, float64(written.Load()-w0) / secs, maxBacklog
	}
	eventually(t, 30*time.Second, "first deliveries", func() bool { return c.distinct() > 100 })
	before, wroteBefore, _ := rate(5 * time.Second)

	lockTx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lockTx.Rollback(ctx) }()
	if _, err := lockTx.Exec(ctx, `LOCK TABLE `+db.Table("outbox")+` IN SHARE UPDATE EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	during, wroteDuring, backlog := rate(30 * time.Second)
	var held bool
	if err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE relation = $1::regclass AND mode = 'ShareUpdateExclusiveLock' AND granted)`,
		db.Table("outbox")).Scan(&held); err != nil {
		t.Fatal(err)
	}
	if err := lockTx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	stopWriters()
	t.Logf("delivered %.0f ev/s before the lock (written %.0f/s), %.0f ev/s while it was held for 30 s (written %.0f/s); largest backlog while held: %d rows",
		before, wroteBefore, during, wroteDuring, backlog)
	if !held {
		t.Fatal("the lock was not held through the window")
	}
	// The writers' rate moves with the machine's load; delivery keeps its rate when it keeps up
	// with them.
	if during < 0.95*wroteDuring {
		t.Fatalf("delivery fell to %.0f ev/s while SHARE UPDATE EXCLUSIVE was held, with %.0f events/s written meanwhile (%.0f ev/s before): the relay waits for the lock", during, wroteDuring, before)
	}
	if limit := int(wroteDuring) + 1000; backlog > limit {
		t.Fatalf("the backlog grew to %d rows while the lock was held (more than a second of writes, %d): the relay waits for the lock", backlog, limit)
	}
	c.waitDistinct(t, int(written.Load()), time.Minute)
}

// TestAutovacuumOfOutboxCompletesUnderLoad: autovacuum of the outbox, slowed down so that it
// holds its lock for seconds, runs to completion while writers commit and the relay drains:
// nothing the relay does waits for its lock (a lock request that waits behind autovacuum for
// deadlock_timeout makes PostgreSQL cancel it, "canceling autovacuum task"), and delivery goes
// on meanwhile. Autovacuum is woken every second for this (autovacuum_naptime, a server
// setting, restored at the end).
func TestAutovacuumOfOutboxCompletesUnderLoad(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	var superuser bool
	if err := db.Pool.QueryRow(ctx, `SELECT rolsuper FROM pg_roles WHERE rolname = current_user`).Scan(&superuser); err != nil {
		t.Fatal(err)
	}
	if !superuser {
		t.Fatal("this test sets autovacuum_naptime with ALTER SYSTEM: run it as a superuser (the embedded server's default) or against a server whose autovacuum_naptime is 1s")
	}
	if _, err := db.Pool.Exec(ctx, `ALTER SYSTEM SET autovacuum_naptime = '1s'`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `SELECT pg_reload_conf()`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = db.Pool.Exec(context.Background(), `ALTER SYSTEM RESET autovacuum_naptime`)
		_, _ = db.Pool.Exec(context.Background(), `SELECT pg_reload_conf()`)
	})
	// Vacuumed after 8,000 dead rows, and slowly: about one page per 100 ms, so it holds its lock
	// for seconds, across several of the relay's batches.
	if _, err := db.Pool.Exec(ctx, `ALTER TABLE `+db.Table("outbox")+` SET (autovacuum_vacuum_threshold = 8000, autovacuum_vacuum_scale_factor = 0,
		autovacuum_vacuum_insert_threshold = -1, autovacuum_analyze_threshold = 1000000000, autovacuum_vacuum_cost_delay = 100, autovacuum_vacuum_cost_limit = 1)`); err != nil {
		t.Fatal(err)
	}
	brokers := kafkatest.Brokers(t, 4)
	topic := kafkatest.Topic("autovac")
	c := newConsumer(t, brokers, topic)
	startRelay(t, newKafkaRelay(t, db, brokers, relay.Config{StatementTimeout: 5 * time.Second}))
	written, stopWriters := pacedWriters(t, db, topic, 8, 10*time.Millisecond)

	vacuums := func() (n int64) {
		if err := db.Pool.QueryRow(ctx, `SELECT autovacuum_count FROM pg_stat_all_tables WHERE relid = $1::regclass`, db.Table("outbox")).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	worker := func() (pid int32) {
		err := db.Pool.QueryRow(ctx, `SELECT pid FROM pg_stat_progress_vacuum WHERE relid = $1::regclass`, db.Table("outbox")).Scan(&pid)
		if err != nil && err != pgx.ErrNoRows {
			t.Fatal(err)
		}
		return pid
	}
	var pid int32
	eventually(t, 90*time.Second, "an autovacuum of the outbox to start", func() bool { pid = worker(); return pid != 0 })
	done0 := vacuums()
	started, delivered0 := time.Now(), c.distinct()
	eventually(t, 3*time.Minute, "the autovacuum to end", func() bool { return worker() != pid })
	took, delivered := time.Since(started), c.distinct()-delivered0
	// The statistics of a finished vacuum reach pg_stat_all_tables a moment after it ends.
	eventually(t, 10*time.Second, "the autovacuum to be counted as completed (it was cancelled)", func() bool { return vacuums() > done0 })
	stopWriters()
	t.Logf("autovacuum of the outbox ran %s to completion; %d events delivered meanwhile", took.Round(time.Millisecond), delivered)
	if took > 2*time.Second && delivered == 0 {
		t.Fatalf("nothing was delivered during the %s the autovacuum ran", took)
	}
	// The embedded server's log (absent with DATABASE_URL): PostgreSQL logs each cancellation.
	var dataDir string
	if err := db.Pool.QueryRow(ctx, `SHOW data_directory`).Scan(&dataDir); err != nil {
		t.Fatal(err)
	}
	if log, err := os.ReadFile(filepath.Join(filepath.Dir(dataDir), "server.log")); err == nil {
		for rest := string(log); ; {
			i := strings.Index(rest, "canceling autovacuum task")
			if i < 0 {
				break
			}
			if around := rest[i:min(len(rest), i+400)]; strings.Contains(around, db.Schema) {
				t.Fatalf("the server log shows an autovacuum of this test's outbox cancelled:\n%s", around)
			}
			rest = rest[i+1:]
		}
	}
	c.waitDistinct(t, int(written.Load()), time.Minute)
}
