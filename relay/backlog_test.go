package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/relay"
)

// Backlog counts exactly up to relay.ExactBacklogRows and estimates above, within the id
// span; the oldest row is the one with the lowest id, and parked rows are counted.
func TestBacklog(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	admin, err := relay.NewAdmin(db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	b, err := admin.Backlog(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if b.Rows != 0 || !b.Exact || b.OldestID != 0 || b.OldestAge() != 0 || b.Parked != 0 {
		t.Fatalf("empty outbox: %+v", b)
	}
	insert := func(n int, age string) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("outbox")+` (event_id, topic, key_hash, payload, created_at)
			SELECT gen_random_uuid(), 't', g, 'x', now() - $2::interval FROM generate_series(1, $1) g`, n, age); err != nil {
			t.Fatal(err)
		}
	}
	insert(3, "1 hour")
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("outbox_parked")+` (id, event_id, topic, key_hash, payload, created_at, attempts, last_error)
		VALUES (99, gen_random_uuid(), 't', 1, 'x', now(), 10, 'refused')`); err != nil {
		t.Fatal(err)
	}
	if b, err = admin.Backlog(ctx, db.Pool); err != nil {
		t.Fatal(err)
	}
	if b.Rows != 3 || !b.Exact || b.OldestID != 1 || b.NewestID != 3 || b.Parked != 1 || b.OldestAge() < 59*time.Minute {
		t.Fatalf("3 rows, one parked: %+v (oldest age %s)", b, b.OldestAge())
	}
	insert(relay.ExactBacklogRows+500, "0 seconds")
	if b, err = admin.Backlog(ctx, db.Pool); err != nil {
		t.Fatal(err)
	}
	total := int64(relay.ExactBacklogRows + 503)
	if b.Exact || b.Rows <= relay.ExactBacklogRows || b.Rows > total || b.OldestID != 1 || b.NewestID != total {
		t.Fatalf("%d rows: %+v, want an estimate in (%d, %d]", total, b, relay.ExactBacklogRows, total)
	}
}
