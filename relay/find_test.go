package relay_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/relay"
)

// seedLeases sets up five shards and two relays: relay-a live, holding shards 0 and 1;
// relay-b, whose heartbeat row expired, holding shard 2 with an expired lease and shard 3
// with a lease not yet expired; shard 4 free.
func seedLeases(t *testing.T, db *testdb.DB) {
	t.Helper()
	ctx := context.Background()
	for _, sql := range []string{
		`INSERT INTO ` + db.Table("relay_member") + ` (id, host, pid, started_at, heartbeat_at, expires_at) VALUES
			('relay-a', 'host-a', 11, now() - interval '1 hour', now() - interval '10 seconds', now() + interval '1 minute'),
			('relay-b', 'host-b', 22, now() - interval '2 hours', now() - interval '2 minutes', now() - interval '1 minute')`,
		`INSERT INTO ` + db.Table("relay_lease") + ` (shard, owner, expires_at) VALUES
			(0, 'relay-a', now() + interval '1 minute'), (1, 'relay-a', now() + interval '1 minute'),
			(2, 'relay-b', now() - interval '1 minute'), (3, 'relay-b', now() + interval '1 minute'), (4, '', 'epoch')`,
	} {
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
}

// Find returns an event's pending and parked rows, each ordered by id, with the shard the
// relays compute (key_hash % shards) and that shard's lease owner, live or expired.
func TestAdminFind(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	admin, err := relay.NewAdmin(db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	find := func(id string) relay.Found {
		t.Helper()
		f, err := admin.Find(ctx, db.Pool, id)
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	pending, parked, both := uuid.NewString(), uuid.NewString(), uuid.NewString()
	insert := func(id string, keyHash int64, meta string, attempts int, lastErr any) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("outbox")+` (event_id, topic, partition_key, key_hash, payload, metadata, attempts, last_error)
			VALUES ($1, 'orders', 'k', $2, 'abc', $3, $4, $5)`, id, keyHash, meta, attempts, lastErr); err != nil {
			t.Fatal(err)
		}
	}
	park := func(id string, outboxID, keyHash int64) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("outbox_parked")+` (id, event_id, topic, partition_key, key_hash, payload, metadata, created_at, attempts, last_error, parked_at, parked_by)
			VALUES ($1, $2, 'orders', 'k', $3, 'abcd', '{"trace":"t1"}', now() - interval '1 hour', 5, 'message too large', now() - interval '1 minute', 'relay-b')`,
			outboxID, id, keyHash); err != nil {
			t.Fatal(err)
		}
	}
	insert(pending, 5, `{"seq":"1"}`, 2, "broker said no")
	park(parked, 9000, 7)
	insert(both, 9, `{"a":1}`, 0, nil) // metadata that is not an object of strings
	park(both, 9002, 8)
	park(both, 9001, 7)
	insert(both, 5, `{}`, 0, nil)

	// Before any relay started: no shards, so no shard and no owner.
	f := find(pending)
	if f.Where() != "pending" || len(f.Pending) != 1 || len(f.Parked) != 0 {
		t.Fatalf("pending event without shards: %+v", f)
	}
	if l := f.Pending[0].ShardLease; l != (relay.ShardLease{}) {
		t.Errorf("lease of a row with no shards: %+v, want none", l)
	}

	seedLeases(t, db)
	f = find(strings.ToUpper(pending)) // any spelling of the UUID
	if f.EventID != pending || f.Where() != "pending" || len(f.Pending) != 1 || len(f.Parked) != 0 {
		t.Fatalf("pending event: %+v", f)
	}
	r := f.Pending[0]
	if r.EventID != pending || r.Topic != "orders" || r.Key != "k" || r.Size != 3 || r.Attempts != 2 || r.LastError != "broker said no" ||
		r.Metadata["seq"] != "1" || time.Since(r.CreatedAt) > time.Minute {
		t.Errorf("pending row: %+v", r)
	}
	if want := (relay.ShardLease{Shard: 0, Owner: "relay-a", OwnerLive: true}); r.ShardLease != want {
		t.Errorf("pending row's lease: %+v, want %+v", r.ShardLease, want)
	}

	f = find(parked)
	if f.Where() != "parked" || len(f.Pending) != 0 || len(f.Parked) != 1 {
		t.Fatalf("parked event: %+v", f)
	}
	p := f.Parked[0]
	if p.ID != 9000 || p.EventID != parked || p.Size != 4 || p.Attempts != 5 || p.LastError != "message too large" || p.ParkedBy != "relay-b" ||
		p.Metadata["trace"] != "t1" || p.ParkedAt.IsZero() || p.CreatedAt.After(p.ParkedAt) {
		t.Errorf("parked row: %+v", p)
	}
	if want := (relay.ShardLease{Shard: 2, Owner: "relay-b", OwnerLive: false}); p.ShardLease != want {
		t.Errorf("parked row's lease: %+v, want %+v (expired)", p.ShardLease, want)
	}

	f = find(both)
	if f.Where() != "pending+parked" || len(f.Pending) != 2 || len(f.Parked) != 2 {
		t.Fatalf("pending and parked event: %+v", f)
	}
	if f.Pending[0].ID >= f.Pending[1].ID || f.Parked[0].ID != 9001 || f.Parked[1].ID != 9002 {
		t.Errorf("rows not ordered by id: pending %d, %d; parked %d, %d", f.Pending[0].ID, f.Pending[1].ID, f.Parked[0].ID, f.Parked[1].ID)
	}
	if got := f.Pending[0].Metadata; got["(undecodable)"] != `{"a": 1}` {
		t.Errorf("undecodable metadata shown as %v", got)
	}
	if want := (relay.ShardLease{Shard: 4}); f.Pending[0].ShardLease != want { // 9 % 5: the free shard
		t.Errorf("lease of a free shard: %+v, want %+v", f.Pending[0].ShardLease, want)
	}
	if want := (relay.ShardLease{Shard: 3, Owner: "relay-b", OwnerLive: true}); f.Parked[1].ShardLease != want { // 8 % 5
		t.Errorf("lease of shard 3: %+v, want %+v", f.Parked[1].ShardLease, want)
	}

	gone := uuid.NewString()
	f = find(gone)
	if f.EventID != gone || f.Where() != "gone" || f.Pending == nil || f.Parked == nil || len(f.Pending)+len(f.Parked) != 0 {
		t.Errorf("event in neither table: %+v", f)
	}

	if _, err := admin.Find(ctx, db.Pool, "not-a-uuid"); err == nil || !strings.Contains(err.Error(), "not an event id") {
		t.Errorf("Find of a bad id: %v", err)
	}
}

// Relays lists each relay with its live leases and heartbeat; Shards counts the shards
// without a live owner: free, lease expired, or held by a relay whose heartbeat expired.
func TestAdminRelaysAndShards(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	admin, err := relay.NewAdmin(db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	members, err := admin.Relays(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	sc, err := admin.Shards(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if len(members) != 0 || sc != (relay.ShardCount{}) {
		t.Fatalf("before any relay: members %+v, shards %+v", members, sc)
	}

	seedLeases(t, db)
	if members, err = admin.Relays(ctx, db.Pool); err != nil {
		t.Fatal(err)
	}
	if len(members) != 2 {
		t.Fatalf("members: %+v, want relay-a and relay-b", members)
	}
	a, b := members[0], members[1]
	if a.ID != "relay-a" || a.Host != "host-a" || a.PID != 11 || !a.Live || a.Shards != 2 ||
		a.HeartbeatAge < 10*time.Second || a.HeartbeatAge > time.Minute || a.StartedAt.After(a.HeartbeatAt) {
		t.Errorf("live relay: %+v", a)
	}
	// relay-b's heartbeat row expired; it still holds one lease that has not expired.
	if b.ID != "relay-b" || b.Live || b.Shards != 1 || b.HeartbeatAge < 2*time.Minute || b.HeartbeatAge > 3*time.Minute {
		t.Errorf("expired relay: %+v", b)
	}
	if sc, err = admin.Shards(ctx, db.Pool); err != nil {
		t.Fatal(err)
	}
	if want := (relay.ShardCount{Total: 5, Unowned: 3}); sc != want {
		t.Errorf("shards: %+v, want %+v (shard 2 expired, 3 held by an expired relay, 4 free)", sc, want)
	}

	// Summary reads the members through Relays.
	s, err := admin.Summary(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Members) != 2 || s.Members[0].Shards != 2 || s.Members[1].Live || s.Shards != 5 {
		t.Errorf("summary: members %+v, shards %d", s.Members, s.Shards)
	}
}
