package inbox_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
)

func TestMain(m *testing.M) {
	// The Kafka kill test re-executes this binary as a consumer process it can SIGKILL.
	if mode := os.Getenv(childEnv); mode != "" {
		os.Exit(childMain(mode))
	}
	testdb.Main(m)
}

// fixture is one test's database with an effect table and an inbox.
type fixture struct {
	t       *testing.T
	db      *testdb.DB
	ib      *inbox.Inbox
	metrics *inbox.Counters
}

func newFixture(t *testing.T, mod func(*inbox.Config)) *fixture {
	t.Helper()
	db := testdb.New(t)
	createEffectTable(t, db)
	f := &fixture{t: t, db: db, metrics: &inbox.Counters{}}
	f.ib = f.newInbox(mod)
	return f
}

func createEffectTable(t *testing.T, db *testdb.DB) {
	t.Helper()
	// No unique constraint on purpose: an effect applied twice shows up as two rows.
	if _, err := db.Pool.Exec(context.Background(),
		`CREATE TABLE `+db.Table("effect")+` (id bigserial PRIMARY KEY, msg_uuid text NOT NULL, note text NOT NULL DEFAULT '')`); err != nil {
		t.Fatal(err)
	}
}

func (f *fixture) newInbox(mod func(*inbox.Config)) *inbox.Inbox {
	f.t.Helper()
	cfg := inbox.Config{Pool: f.db.Pool, Schema: f.db.Schema, Consumer: "billing", Metrics: f.metrics}
	if mod != nil {
		mod(&cfg)
	}
	ib, err := inbox.New(cfg)
	if err != nil {
		f.t.Fatal(err)
	}
	return ib
}

// applyEffect is the handlers' effect: one row in the inbox transaction.
func (f *fixture) applyEffect(msg *message.Message, note string) error {
	_, err := outbox.MustTx(msg.Context()).Exec(msg.Context(), `INSERT INTO `+f.db.Table("effect")+` (msg_uuid, note) VALUES ($1, $2)`, msg.UUID, note)
	return err
}

func (f *fixture) count(sql string, args ...any) int {
	f.t.Helper()
	var n int
	if err := f.db.Pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		f.t.Fatalf("%s: %v", sql, err)
	}
	return n
}

func (f *fixture) effects(uuid string) int {
	return f.count(`SELECT count(*) FROM `+f.db.Table("effect")+` WHERE msg_uuid = $1`, uuid)
}

func (f *fixture) dedupRows() int {
	return f.count(`SELECT count(*) FROM ` + f.db.Table("processed_event"))
}

func (f *fixture) outboxRows() []outboxRow {
	f.t.Helper()
	rows, err := f.db.Pool.Query(context.Background(), `SELECT event_id::text, topic, partition_key, payload, metadata FROM `+f.db.Table("outbox")+` ORDER BY id`)
	if err != nil {
		f.t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (outboxRow, error) {
		var x outboxRow
		err := r.Scan(&x.EventID, &x.Topic, &x.Key, &x.Payload, &x.Metadata)
		return x, err
	})
	if err != nil {
		f.t.Fatal(err)
	}
	return out
}

type outboxRow struct {
	EventID  string
	Topic    string
	Key      string
	Payload  []byte
	Metadata map[string]string
}

// waitFor polls cond until it holds or a generous deadline passes. It awaits a state, it
// does not measure speed.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func snapshot(f *fixture) inbox.CountersSnapshot { return f.metrics.Snapshot() }
