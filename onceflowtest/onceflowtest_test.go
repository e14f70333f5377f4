package onceflowtest_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
)

func TestMain(m *testing.M) { onceflowtest.Main(m) }

// A test's database has the onceflow schema migrated, takes the test's own tables in public,
// works with the package-level outbox.WriteTx, is invisible to another test's, and is dropped
// when the test ends.
func TestNewDB(t *testing.T) {
	ctx := context.Background()
	var name string
	var other *onceflowtest.DB
	t.Run("db", func(t *testing.T) {
		db := onceflowtest.NewDB(t)
		other = onceflowtest.NewDB(t)
		name = db.Name
		if db.Schema != "onceflow" {
			t.Fatalf("Schema = %q, want onceflow", db.Schema)
		}
		if _, err := db.Pool.Exec(ctx, `CREATE TABLE orders (id int PRIMARY KEY)`); err != nil {
			t.Fatal(err)
		}
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO orders VALUES (1)`); err != nil {
				return err
			}
			return outbox.WriteTx(ctx, tx, "orders.placed", outbox.NewMessage([]byte(`{}`)))
		})
		if err != nil {
			t.Fatal(err)
		}
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM onceflow.outbox`).Scan(&n); err != nil || n != 1 {
			t.Fatalf("outbox rows = %d (%v), want 1", n, err)
		}
		if err := other.Pool.QueryRow(ctx, `SELECT count(*) FROM onceflow.outbox`).Scan(&n); err != nil || n != 0 {
			t.Fatalf("the other test's outbox rows = %d (%v), want 0", n, err)
		}
		if _, err := other.Pool.Exec(ctx, `SELECT * FROM orders`); err == nil {
			t.Fatal("the other test's database sees this test's table")
		}
		// DatabaseURL reaches the same database, for clients of one's own.
		conn, err := pgx.Connect(ctx, db.DatabaseURL)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		var current string
		if err := conn.QueryRow(ctx, `SELECT current_database()`).Scan(&current); err != nil || current != db.Name {
			t.Fatalf("DatabaseURL connects to %q (%v), want %q", current, err, db.Name)
		}
	})
	probe := onceflowtest.NewDB(t)
	var exists bool
	if err := probe.Pool.QueryRow(ctx, `SELECT exists (SELECT FROM pg_database WHERE datname = $1)`, name).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	if exists {
		t.Fatalf("database %s still exists after its test ended", name)
	}
	if err := other.Pool.Ping(ctx); err == nil {
		t.Fatal("the pool is still open after its test ended")
	}
}

// Seeded topics exist with the partitions asked for; others are not created on first use.
func TestNewKafka(t *testing.T) {
	if os.Getenv("KAFKA_BROKERS") != "" {
		t.Skip("KAFKA_BROKERS is set: NewKafka uses that cluster (TestNewKafkaOnKafkaBrokers covers it)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	k := onceflowtest.NewKafka(t, onceflowtest.KafkaOptions{Topics: []string{"orders.placed", "orders.paid"}, Partitions: 3})
	if k.Cluster == nil {
		t.Fatal("Cluster is nil without KAFKA_BROKERS")
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers...), kgo.RecordPartitioner(kgo.ManualPartitioner()),
		kgo.ConsumeTopics("orders.placed"), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.UnknownTopicRetries(0))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if err := cl.ProduceSync(ctx, &kgo.Record{Topic: "orders.placed", Partition: 2, Value: []byte("x")}).FirstErr(); err != nil {
		t.Fatalf("produce to partition 2 of a seeded topic: %v", err)
	}
	fs := cl.PollFetches(ctx)
	if err := fs.Err(); err != nil {
		t.Fatal(err)
	}
	if recs := fs.Records(); len(recs) != 1 || string(recs[0].Value) != "x" || recs[0].Partition != 2 {
		t.Fatalf("consumed %v, want the one record on partition 2", recs)
	}
	err = cl.ProduceSync(ctx, &kgo.Record{Topic: "not.seeded", Value: []byte("x")}).FirstErr()
	if !errors.Is(err, kerr.UnknownTopicOrPartition) {
		t.Fatalf("produce to a topic that was not seeded: %v, want UNKNOWN_TOPIC_OR_PARTITION", err)
	}
}

// Start gives a program the same database and Kafka, and Close releases them (twice is fine).
func TestStart(t *testing.T) {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{Kafka: onceflowtest.KafkaOptions{Topics: []string{"t"}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := env.Pool.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	if len(env.Brokers) == 0 || env.Cluster == nil {
		t.Fatalf("no Kafka: %+v", env.Kafka)
	}
	if err := env.Close(); err != nil {
		t.Fatal(err)
	}
	if err := env.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	probe := onceflowtest.NewDB(t)
	var exists bool
	if err := probe.Pool.QueryRow(ctx, `SELECT exists (SELECT FROM pg_database WHERE datname = $1)`, env.Name).Scan(&exists); err != nil || exists {
		t.Fatalf("database %s exists after Close: %v (%v)", env.Name, exists, err)
	}

	noKafka, err := onceflowtest.Start(ctx, onceflowtest.Options{NoKafka: true})
	if err != nil {
		t.Fatal(err)
	}
	defer noKafka.Close()
	if noKafka.Brokers != nil || noKafka.Cluster != nil {
		t.Fatalf("NoKafka started Kafka: %+v", noKafka.Kafka)
	}

	noDB, err := onceflowtest.Start(ctx, onceflowtest.Options{NoDB: true})
	if err != nil {
		t.Fatal(err)
	}
	defer noDB.Close()
	if noDB.Pool != nil || noDB.DatabaseURL != "" || noDB.Name != "" {
		t.Fatalf("NoDB created a database: %+v", noDB.DB)
	}
	if len(noDB.Brokers) == 0 {
		t.Fatalf("NoDB started no Kafka: %+v", noDB.Kafka)
	}
}

func TestBadKafkaOptions(t *testing.T) {
	for _, opts := range []onceflowtest.Options{
		{NoKafka: false, Kafka: onceflowtest.KafkaOptions{Partitions: -1}},
		{Kafka: onceflowtest.KafkaOptions{Topics: []string{""}}},
	} {
		env, err := onceflowtest.Start(context.Background(), opts)
		if err == nil {
			env.Close()
			t.Fatalf("Start(%+v) succeeded, want an error", opts)
		}
	}
}

// Outside a test binary, Start starts a server of its own (unless DATABASE_URL is set) and
// Close stops it.
func TestStartStandalone(t *testing.T) {
	if os.Getenv("DATABASE_URL") != "" {
		t.Skip("DATABASE_URL is set: Start uses that server")
	}
	defer onceflowtest.SetStandalone(true)()
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{NoKafka: true})
	if err != nil {
		t.Fatal(err)
	}
	shared := onceflowtest.NewDB(t)
	if env.DatabaseURL[:strings.LastIndex(env.DatabaseURL, "/")] == shared.DatabaseURL[:strings.LastIndex(shared.DatabaseURL, "/")] {
		t.Fatalf("standalone Start used the shared server %s", shared.DatabaseURL)
	}
	if err := env.Pool.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	if err := env.Close(); err != nil {
		t.Fatal(err)
	}
	if conn, err := pgx.Connect(ctx, env.DatabaseURL); err == nil {
		conn.Close(ctx)
		t.Fatal("the server still accepts connections after Close")
	}
}

// With KAFKA_BROKERS, NewKafka creates the missing topics on that cluster (here a kfake
// cluster that does not create topics itself) and leaves existing ones alone.
func TestNewKafkaOnKafkaBrokers(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	external, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "existing"))
	if err != nil {
		t.Fatal(err)
	}
	defer external.Close()
	t.Setenv("KAFKA_BROKERS", strings.Join(external.ListenAddrs(), ","))
	k := onceflowtest.NewKafka(t, onceflowtest.KafkaOptions{Topics: []string{"existing", "created"}, Partitions: 2})
	if k.Cluster != nil {
		t.Fatal("Cluster is set although KAFKA_BROKERS is")
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers...), kgo.RecordPartitioner(kgo.ManualPartitioner()), kgo.UnknownTopicRetries(0))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	for _, r := range []*kgo.Record{{Topic: "existing", Partition: 0}, {Topic: "created", Partition: 1}} {
		if err := cl.ProduceSync(ctx, r).FirstErr(); err != nil {
			t.Errorf("produce to %s/%d: %v", r.Topic, r.Partition, err)
		}
	}
}
