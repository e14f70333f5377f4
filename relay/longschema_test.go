package relay_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// TestLongSchemaName: every schema name ValidateSchema accepts (up to 63 bytes) works end to
// end: the outbox write with its notification, the relay woken by LISTEN alone (no poll), and
// a replay, which notifies too. PostgreSQL refuses notification channel names of 64 bytes or
// more, and schema + "_outbox" passes that from 57 bytes of schema name on.
func TestLongSchemaName(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	base := testdb.New(t) // the server, and a schema to drop when the test ends
	schema := base.Schema + "_" + strings.Repeat("x", 63-len(base.Schema)-1)
	if _, err := migrations.Up(ctx, base.Pool, migrations.Options{Schema: schema}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = base.Pool.Exec(context.Background(), "DROP SCHEMA "+pgsql.Ident(schema)+" CASCADE") })
	cfg, err := pgxpool.ParseConfig(base.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	db := &testdb.DB{Pool: pool, Schema: schema, URL: base.URL}

	brokers := kafkatest.Brokers(t, 1)
	topic := kafkatest.Topic("long")
	c := newConsumer(t, brokers, topic)
	rec := newRecorder()
	startRelay(t, newKafkaRelay(t, db, brokers, relay.Config{PollInterval: time.Hour, Metrics: rec}))
	rec.waitFor(t, 30*time.Second, "shards owned", func(r *recorder) bool { return r.owned > 0 })
	eventually(t, 30*time.Second, "the relay to listen", func() bool {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN %' AND query LIKE '%' || $1 || '%'`, schema[:40]).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n > 0
	})

	w, err := outbox.NewWriter(outbox.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	m := outbox.NewMessage([]byte("long"))
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return w.WriteTx(ctx, tx, topic, m) }); err != nil {
		t.Fatalf("write to schema %q (%d bytes): %v", schema, len(schema), err)
	}
	got := c.waitDistinct(t, 1, 30*time.Second) // woken by the notification: the poll is an hour
	if got[0].EventID != m.UUID {
		t.Fatalf("consumed %+v", got)
	}

	// A parked row replays, and the replay's notification wakes the relay as well.
	parked := outbox.NewMessage([]byte("parked"))
	if _, err := pool.Exec(ctx, `INSERT INTO `+db.Table("outbox_parked")+` (id, event_id, topic, key_hash, payload, created_at, attempts, last_error)
		VALUES (1, $1, $2, 0, 'parked', now(), 3, 'test')`, parked.UUID, topic); err != nil {
		t.Fatal(err)
	}
	admin, err := relay.NewAdmin(schema)
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := admin.ReplayTx(ctx, tx, relay.ParkedFilter{All: true})
		return err
	}); err != nil {
		t.Fatalf("replay in schema %q: %v", schema, err)
	}
	c.waitDistinct(t, 2, 30*time.Second)
}
