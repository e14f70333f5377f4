package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay"
)

// TestForeignTransactionDoesNotStall: a write transaction that stays open — touching a
// business table and even the outbox itself, with a smaller outbox id — does not hold back an
// event committed after it; its own row is delivered once it commits.
func TestForeignTransactionDoesNotStall(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 1)
	topic := kafkatest.Topic("stall")
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE `+db.Table("accounts")+` (id int PRIMARY KEY, balance int)`); err != nil {
		t.Fatal(err)
	}
	c := newConsumer(t, brokers, topic)
	startRelay(t, newKafkaRelay(t, db, brokers, relay.Config{}))

	foreign, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = foreign.Rollback(ctx) }() // no-op after the commit below
	if _, err := foreign.Exec(ctx, `INSERT INTO `+db.Table("accounts")+` VALUES (1, 100)`); err != nil {
		t.Fatal(err)
	}
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	early := outbox.NewMessage([]byte("from the open transaction"))
	if err := w.WriteTx(ctx, foreign, topic, early); err != nil {
		t.Fatal(err)
	}

	late := outbox.NewMessage([]byte("committed while the other is open"))
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return w.WriteTx(ctx, tx, topic, late) }); err != nil {
		t.Fatal(err)
	}
	got := c.waitDistinct(t, 1, 30*time.Second) // the foreign transaction is still open here
	if len(got) != 1 || got[0].EventID != late.UUID {
		t.Fatalf("while the foreign transaction is open, consumed %+v; want only the committed event %s", got, late.UUID)
	}

	if err := foreign.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	got = c.waitDistinct(t, 2, 30*time.Second)
	if got[1].EventID != early.UUID {
		t.Fatalf("after commit, consumed %+v; want the foreign event %s second", got, early.UUID)
	}
	eventually(t, 30*time.Second, "empty outbox", func() bool { return outboxCount(t, db) == 0 })
}
