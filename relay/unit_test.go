package relay

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

func TestBackoffDelay(t *testing.T) {
	base, max := 100*time.Millisecond, 30*time.Second
	cases := []struct {
		n      int
		jitter float64
		want   time.Duration
	}{
		{1, 0.5, 100 * time.Millisecond},         // middle of the jitter range = the nominal delay
		{0, 0.5, 100 * time.Millisecond},         // n < 1 counts as the first failure
		{2, 0.5, 200 * time.Millisecond},         // doubles
		{4, 0.5, 800 * time.Millisecond},         //
		{1, 0, 75 * time.Millisecond},            // -25%
		{1, 0.999999, 124999 * time.Microsecond}, // just under +25%
		{30, 0.5, 30 * time.Second},              // capped
		{1000, 0, 22500 * time.Millisecond},      // capped, then jittered; no overflow
	}
	for _, c := range cases {
		got := backoffDelay(base, max, c.n, c.jitter)
		if d := got - c.want; d < -time.Microsecond || d > time.Microsecond {
			t.Errorf("backoffDelay(n=%d, jitter=%v) = %s, want %s", c.n, c.jitter, got, c.want)
		}
	}
}

func TestFairShare(t *testing.T) {
	cases := []struct {
		members []string
		me      string
		shards  int
		want    int
	}{
		{[]string{"a"}, "a", 64, 64},
		{[]string{"a", "b"}, "a", 64, 32},
		{[]string{"a", "b", "c"}, "a", 64, 22}, // 64 = 22 + 21 + 21
		{[]string{"a", "b", "c"}, "b", 64, 21},
		{[]string{"a", "b", "c"}, "c", 64, 21},
		{[]string{"a", "b"}, "c", 64, 21},    // not visible yet: counted last of three
		{[]string{"a", "b", "c"}, "c", 2, 0}, // more relays than shards: the last waits
		{nil, "a", 8, 8},
	}
	for _, c := range cases {
		if got := fairShare(c.members, c.me, c.shards); got != c.want {
			t.Errorf("fairShare(%v, %q, %d) = %d, want %d", c.members, c.me, c.shards, got, c.want)
		}
	}
	// Shares always add up to the shard count.
	for n := 1; n <= 7; n++ {
		var ms []string
		for i := range n {
			ms = append(ms, string(rune('a'+i)))
		}
		total := 0
		for _, m := range ms {
			total += fairShare(ms, m, 64)
		}
		if total != 64 {
			t.Errorf("%d members: shares add up to %d", n, total)
		}
	}
}

func TestConfigValidation(t *testing.T) {
	c, err := Config{}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	if c.Schema != "onceflow" || c.BatchSize != 1000 || c.PollInterval != time.Second || c.Shards != 64 ||
		c.LeaseDuration != 8*time.Second || c.MaxAttempts != 10 || c.InstanceID == "" || c.Logger == nil || c.Metrics == nil {
		t.Fatalf("defaults = %+v", c)
	}
	if got := (Config{}).FailoverBound(); got > 10*time.Second {
		t.Fatalf("default failover bound %s, want ≤ 10s", got)
	}
	if c.fenceMargin() <= 0 || c.renewInterval() >= c.LeaseDuration-c.fenceMargin() {
		t.Fatalf("renewals every %s cannot keep a fence of %s - %s", c.renewInterval(), c.LeaseDuration, c.fenceMargin())
	}
	bad := Config{Schema: "Bad-Name", BatchSize: -1, PollInterval: time.Millisecond, Shards: MaxShards + 1,
		LeaseDuration: time.Millisecond, MaxAttempts: -1, RetryBackoff: time.Second, MaxRetryBackoff: time.Millisecond,
		ShutdownTimeout: -time.Second, InstanceID: strings.Repeat("x", 300)}
	err = bad.Validate()
	var ce *ConfigError
	if !errors.As(err, &ce) || len(ce.Problems) != 9 {
		t.Fatalf("want 9 problems reported at once, got %v", err)
	}
	for _, want := range []string{"schema", "BatchSize", "PollInterval", "Shards", "LeaseDuration", "MaxAttempts", "MaxRetryBackoff", "ShutdownTimeout", "InstanceID"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %s: %v", want, err)
		}
	}
}

func TestClaimSQL(t *testing.T) {
	q := newQueries("s")
	all := snapshot{shards: []int{0, 1}, all: true}
	sql, args := q.nextSQL(all, 2, cursor{}, blockedSet{}, 100, 1<<20)
	if strings.Contains(sql, "key_hash %") || len(args) != 5 || args[0] != int64(0) || args[1] != nil || args[2] != nil {
		t.Fatalf("owning every shard needs no filter, a fresh cursor no reference snapshot: %s %v", sql, args)
	}
	some := snapshot{shards: []int{3, 5}}
	sql, args = q.nextSQL(some, 8, cursor{pos: 42, ref: "10:12:10,11"}, blockedSet{keys: []string{"k"}, ids: []int64{7}}, 50, 1<<20)
	for _, want := range []string{
		`id > (SELECT lo FROM low) AND key_hash % $4 = ANY($5::int[]) AND partition_key <> ALL($6::text[]) AND id <> ALL($7::bigint[]) ORDER BY id LIMIT $8`,
		`tx >= $2::text::xid8`, `tx = ANY($3::text[]::xid8[])`, `id + 0 <= $1 AND key_hash % $4 = ANY($5::int[])`, `OFFSET 0`, `run <= $9 OR rn = 1`,
	} {
		if !strings.Contains(sql, want) {
			t.Errorf("claim SQL lacks %q:\n%s", want, sql)
		}
	}
	if len(args) != 9 || args[0] != int64(42) || args[1] != "12" || fmt.Sprint(args[2]) != "[10 11]" || args[3] != 8 || args[7] != 50 {
		t.Fatalf("claim args %v", args)
	}
	if strings.Contains(sql, "FOR UPDATE") || strings.Contains(sql, "xmin") || strings.Contains(sql, "summarize") {
		t.Fatalf("the claim must read committed rows without locks or waits: %s", sql)
	}
	if xmax, xip := splitSnapshot("5:9:"); xmax != "9" || len(xip) != 0 || xip == nil {
		t.Fatalf("splitSnapshot of an empty list = %q %v", xmax, xip)
	}
	sql, args = q.retrySQL(some, 8, cursor{pos: 42}, blockedSet{dueKeys: []string{"k"}, dueIDs: []int64{9}, floor: 5}, 50, 1<<20)
	if want := `WHERE id >= $1 AND id <= $2 AND key_hash % $3 = ANY($4::int[]) AND (partition_key = ANY($5::text[]) OR id = ANY($6::bigint[])) ORDER BY id LIMIT $7`; !strings.Contains(sql, want) {
		t.Fatalf("retry SQL lacks %q:\n%s", want, sql)
	}
	if args[0] != int64(5) || args[1] != int64(42) {
		t.Fatalf("retry args %v", args)
	}
}

func TestBlockList(t *testing.T) {
	now := time.Now()
	b := newBlockList(100*time.Millisecond, time.Second)
	k := &Message{ID: 10, Key: "K", blockKey: blockKeyOf("K", 10)}
	free := &Message{ID: 20, blockKey: blockKeyOf("", 20)}
	d1 := b.fail(k, 0, now)
	b.fail(free, 0, now)
	s := b.plan(now)
	if len(s.keys) != 1 || s.keys[0] != "K" || len(s.ids) != 1 || s.ids[0] != 20 || s.next.IsZero() || s.anyDue() {
		t.Fatalf("plan = %+v", s)
	}
	d2 := b.fail(k, 0, now)
	if d2 <= d1*5/4 { // doubled, whatever the jitter (±25%)
		t.Fatalf("second failure waits %s, first %s: no exponential growth", d2, d1)
	}
	if d := b.fail(k, 9, now); d < 750*time.Millisecond {
		t.Fatalf("a row with 9 persisted attempts waits %s, want the cap (±25%%)", d)
	}
	later := now.Add(2 * time.Second) // every wait over
	s = b.plan(later)
	if len(s.dueKeys) != 1 || len(s.dueIDs) != 1 || s.floor != 10 || len(s.keys) != 1 || !s.next.IsZero() {
		t.Fatalf("due plan = %+v", s)
	}
	b.lowerFloors(4)
	if s = b.plan(later); s.floor != 4 {
		t.Fatalf("floor after a late commit = %d, want 4", s.floor)
	}
	// A retry that stopped before the cursor keeps the chains due, from after its last row.
	deleted := func(*Message) bool { return true }
	b.ok(k)
	b.retried(s, []*Message{k}, deleted, false, later)
	if e := b.entries[k.blockKey]; e == nil || e.floor != 11 || e.until.After(later) {
		t.Fatalf("partial retry: entry %+v, want floor 11 and due", e)
	}
	// An abandoned row is retried from itself.
	s = b.plan(later)
	b.retried(s, []*Message{k}, func(*Message) bool { return false }, true, later)
	if e := b.entries[k.blockKey]; e == nil || e.floor != 10 {
		t.Fatalf("abandoned retry: entry %+v, want floor 10", e)
	}
	// A complete retry forgets every due chain.
	s = b.plan(later)
	b.retried(s, nil, deleted, true, later)
	if len(b.entries) != 0 {
		t.Fatalf("complete retry left %d entries", len(b.entries))
	}
}

// serverChanged: a claim on a server started at another time, or whose snapshot's xmax is
// below the cursor's reference snapshot (transaction ids went backwards), means the cursor
// must restart; the first claim, the same server, and ids moving forward do not.
func TestServerChanged(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name    string
		server  time.Time // the relay's, before the claim
		ref     string    // the cursor's reference snapshot
		c       claimed
		changed bool
	}{
		{"first claim", time.Time{}, "", claimed{kind: claimNext, server: t0, snap: "5:9:"}, false},
		{"same server", t0, "5:9:", claimed{kind: claimNext, server: t0, snap: "9:12:10"}, false},
		{"restarted or failed over", t0, "5:9:", claimed{kind: claimNext, server: t0.Add(time.Second), snap: "20:20:"}, true},
		{"xids went backwards", t0, "900:918:", claimed{kind: claimNext, server: t0, snap: "768:768:"}, true},
		{"retry claims carry no snapshot", t0, "900:918:", claimed{kind: claimRetry, server: t0}, false},
	} {
		r := &Relay{server: tc.server, cur: cursor{pos: 10, ref: tc.ref}}
		if got, why := r.serverChanged(&tc.c); got != tc.changed {
			t.Errorf("%s: changed = %v (%s), want %v", tc.name, got, why, tc.changed)
		}
		if !r.server.Equal(tc.c.server) {
			t.Errorf("%s: the relay's server is %v after the claim, want %v", tc.name, r.server, tc.c.server)
		}
	}
}
