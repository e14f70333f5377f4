// Package onceflowtest gives your own tests, Examples and local programs the infrastructure
// onceflow runs on, with nothing to install but the PostgreSQL binaries: a throwaway
// PostgreSQL with the onceflow schema migrated, and an in-process Kafka (franz-go's kfake) with
// your topics created. River's rivertest plays the same part for River.
//
// In a test:
//
//	func TestMain(m *testing.M) { onceflowtest.Main(m) } // stops the server after the tests
//
//	func TestBilling(t *testing.T) {
//		db := onceflowtest.NewDB(t) // a fresh, migrated database
//		kafka := onceflowtest.NewKafka(t, onceflowtest.KafkaOptions{Topics: []string{"orders.placed"}})
//		ib, err := inbox.New(inbox.Config{Pool: db.Pool, Consumer: "billing"})
//		sub, err := inboxkafka.NewSubscriber(kafka.Brokers, "billing", logger)
//		// ... the same code as in the service: nothing here names a test schema.
//	}
//
// Outside a test (an Example, a demo program):
//
//	env, err := onceflowtest.Start(ctx, onceflowtest.Options{
//		Kafka: onceflowtest.KafkaOptions{Topics: []string{"orders.placed"}},
//	})
//	if err != nil {
//		return err
//	}
//	defer env.Close()
//	// env.Pool, env.DatabaseURL, env.Brokers: the same as NewDB's and NewKafka's
//
// A service that wants its tables in a schema of its own migrates it itself, on the same pool:
// migrations.Up(ctx, db.Pool, migrations.Options{Schema: "orders"}).
//
// # PostgreSQL
//
// With DATABASE_URL set, that server is used; its role needs the CREATEDB privilege. Otherwise
// a cluster is started from the installed binaries (initdb and pg_ctl on PATH or in
// /usr/lib/postgresql/*/bin; as the "postgres" user when running as root, because PostgreSQL
// refuses root) in a temporary folder, with fsync off, and removed afterwards. It starts in
// about a second. In a test binary one server is shared by every NewDB and Start of the
// process and stopped by Main; elsewhere each Env owns its server and Close stops it. A
// cluster whose process died without stopping it is removed by the next start.
//
// Each NewDB or Start gets a database of its own, created for it and dropped afterwards, with
// every onceflow migration applied to the default schema "onceflow" — the state
// `onceflow migrate up` leaves a service's database in. So code under test keeps its default
// configuration (outbox.WriteTx, inbox.Config{Pool, Consumer}, relay.Config{Pool, Sink}), its
// own unqualified tables land in the database's "public" schema, and tests run in parallel
// without seeing each other's rows, notifications or advisory locks.
//
// # Kafka
//
// With KAFKA_BROKERS set (comma separated), that cluster is used and the topics are created
// on it if missing; topics are shared there, so give parallel tests distinct topic names.
// Otherwise an in-process kfake cluster speaking the real Kafka protocol is started with the
// topics created, and closed afterwards; KafkaOptions.Partitions sets their partitions.
// kfake's Cluster is exposed to inject broker errors (Cluster.ControlKey). Like most
// production clusters, it does not create topics on first use unless AutoCreateTopics is
// set: a topic the service forgot to create fails the test instead of the deployment (the
// relay retries an unknown topic until it exists).
package onceflowtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceflow/onceflow/internal/embedded"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/testdb"
)

// setupTimeout bounds starting a server, creating a database and migrating it.
const setupTimeout = 2 * time.Minute

// Main runs the package's tests, stops the PostgreSQL server that NewDB or Start started (if
// any), fails the run when goroutines are left running after passing tests (go.uber.org/goleak,
// ignoring sarama's metrics ticker, which nothing can stop), and exits. Use it from TestMain:
//
//	func TestMain(m *testing.M) { onceflowtest.Main(m) }
//
// Without it, the server of a test binary outlives the tests until the next run removes it.
func Main(m *testing.M) { testdb.Main(m) }

// DB is one test's database.
type DB struct {
	// Pool connects to the database with default settings (search_path "$user", public): the
	// onceflow tables are in Schema, the test's own tables go to public.
	Pool *pgxpool.Pool
	// Schema holds the onceflow tables, migrated: always "onceflow", the default of every
	// onceflow Config, so nothing needs to name it.
	Schema string
	// DatabaseURL connects to this database, for clients of your own and child processes
	// (`onceflow relay --database-url`). It carries DATABASE_URL's password, if any: print
	// Name rather than the URL.
	DatabaseURL string
	// Name is the database's name.
	Name string
}

// NewDB creates a database with every onceflow migration applied and returns a pool on it.
// The pool is closed and the database dropped when the test ends. It fails the test with the
// reason when no PostgreSQL is available (no binaries and no DATABASE_URL).
func NewDB(t testing.TB) *DB {
	t.Helper()
	url := testdb.URL(t)
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	db, drop, err := newDatabase(ctx, url)
	if err != nil {
		t.Fatalf("onceflowtest: %v", pgsql.RedactError(err, url))
	}
	t.Cleanup(func() {
		if err := drop(); err != nil {
			t.Logf("onceflowtest: %v", pgsql.RedactError(err, url))
		}
	})
	return db
}

// KafkaOptions configures NewKafka and the Kafka of Start.
type KafkaOptions struct {
	// Topics are created before NewKafka returns.
	Topics []string
	// Partitions per created topic. Default 1. On KAFKA_BROKERS it applies to topics that
	// did not exist.
	Partitions int32
	// AutoCreateTopics lets the in-process cluster create a topic on first use, with
	// Partitions partitions. Default false, as on most production clusters. Ignored with
	// KAFKA_BROKERS (the cluster's own setting applies).
	AutoCreateTopics bool
}

// Kafka is a Kafka cluster for a test.
type Kafka struct {
	// Brokers are the host:port addresses to give a client (relaykafka.Config.Brokers,
	// inboxkafka.NewSubscriber).
	Brokers []string
	// Cluster is the in-process kfake cluster, for injecting broker errors with ControlKey.
	// Nil when KAFKA_BROKERS is set.
	Cluster *kfake.Cluster
}

// NewKafka returns the cluster in KAFKA_BROKERS, or starts an in-process one closed when the
// test ends, with opts.Topics created on it.
func NewKafka(t testing.TB, opts KafkaOptions) *Kafka {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	k, err := startKafka(ctx, opts)
	if err != nil {
		t.Fatalf("onceflowtest: %v", err)
	}
	t.Cleanup(k.close)
	return k
}

// Options configures Start.
type Options struct {
	// Kafka configures the Kafka cluster: the topics to create and their partitions.
	Kafka KafkaOptions
	// NoKafka skips Kafka: for programs that only need the database.
	NoKafka bool
	// NoDB skips PostgreSQL (Env.DB stays zero): for programs that only need Kafka, or that
	// use DATABASE_URL's database as it is instead of a throwaway one, e.g. a service that
	// starts an embedded server only for what is not configured:
	//
	//	onceflowtest.Start(ctx, onceflowtest.Options{
	//		NoDB:    os.Getenv("DATABASE_URL") != "",
	//		NoKafka: os.Getenv("KAFKA_BROKERS") != "",
	//	})
	NoDB bool
	// Logf receives one line per server saying which one is used (DATABASE_URL, KAFKA_BROKERS,
	// or the embedded ones, started and stopped), e.g. log.Printf. Default: discard.
	Logf func(format string, args ...any)
}

// Env is infrastructure started by Start: a migrated database and a Kafka cluster.
type Env struct {
	DB
	Kafka

	closers []func() error
}

// Start is NewDB and NewKafka for code that has no testing.TB: an Example, or a program run
// with `go run` on a machine without servers. Close releases everything it started, in reverse
// order; call it before the program exits, or the cluster's processes outlive it (the next
// start removes them). See the package documentation for which servers it uses.
func Start(ctx context.Context, opts Options) (*Env, error) {
	ctx, cancel := context.WithTimeout(ctx, setupTimeout)
	defer cancel()
	if !opts.NoKafka {
		if err := opts.Kafka.check(); err != nil {
			return nil, fmt.Errorf("onceflowtest: %w", err)
		}
	}
	env := &Env{}
	logf := opts.Logf
	if logf == nil {
		logf = func(string, ...any) {}
	}
	if !opts.NoDB {
		if err := env.startDB(ctx, logf); err != nil {
			return nil, errors.Join(err, env.Close())
		}
	}
	if !opts.NoKafka {
		k, err := startKafka(ctx, opts.Kafka)
		if err != nil {
			return nil, errors.Join(fmt.Errorf("onceflowtest: %w", err), env.Close())
		}
		env.Kafka = *k
		env.closers = append(env.closers, func() error { k.close(); return nil })
		if k.Cluster != nil {
			logf("onceflowtest: in-process Kafka (kfake) at %s, topics %v", strings.Join(k.Brokers, ","), opts.Kafka.Topics)
		} else {
			logf("onceflowtest: Kafka from KAFKA_BROKERS, topics %v", opts.Kafka.Topics)
		}
	}
	return env, nil
}

// startDB is Start's PostgreSQL part: a server (DATABASE_URL's, the test binary's shared
// one, or one of its own) and a migrated database on it. What it started is in e.closers.
func (e *Env) startDB(ctx context.Context, logf func(string, ...any)) error {
	url := os.Getenv("DATABASE_URL")
	switch {
	case url != "":
		logf("onceflowtest: PostgreSQL from DATABASE_URL")
	case !standalone:
		// The test binary's shared server, stopped by Main (or by testdb.Main in onceflow's
		// own packages): one cluster for all Examples and tests instead of one each.
		var tb errTB
		url = testdb.URL(&tb)
		if tb.err != nil {
			return fmt.Errorf("onceflowtest: %w", tb.err)
		}
	default:
		pg, err := embedded.StartPostgres(ctx, embedded.PostgresOptions{Logf: logf})
		if err != nil {
			return fmt.Errorf("onceflowtest: %w", err)
		}
		e.closers = append(e.closers, func() error {
			logf("onceflowtest: stopping the embedded PostgreSQL")
			return pg.Stop()
		})
		url = pg.URL()
	}
	db, drop, err := newDatabase(ctx, url)
	if err != nil {
		return fmt.Errorf("onceflowtest: %w", pgsql.RedactError(err, url))
	}
	e.DB = *db
	e.closers = append(e.closers, drop)
	logf("onceflowtest: database %s created, onceflow schema migrated", db.Name)
	return nil
}

// Close closes the pool, drops the database, closes the Kafka cluster and stops the
// PostgreSQL cluster Start started, and reports what failed. Calling it again does nothing.
func (e *Env) Close() error {
	var errs []error
	for i := len(e.closers) - 1; i >= 0; i-- {
		errs = append(errs, e.closers[i]())
	}
	e.closers = nil
	return errors.Join(errs...)
}

// standalone is false in a test binary, where Start shares the process's server.
var standalone = !testing.Testing()

// errTB is the little of testing.TB that testdb.URL uses, recording the failure as an error.
type errTB struct {
	testing.TB
	err error
}

func (*errTB) Helper() {}

func (e *errTB) Fatalf(format string, args ...any) { e.err = fmt.Errorf(format, args...) }
