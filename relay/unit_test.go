package relay

import (
	"errors"
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
	sql, args := q.claimSQL(all, 2, nil, nil, 100)
	if strings.Contains(sql, "WHERE") || len(args) != 1 {
		t.Fatalf("owning every shard needs no filter: %s %v", sql, args)
	}
	some := snapshot{shards: []int{3, 5}}
	sql, args = q.claimSQL(some, 8, []string{"k"}, []int64{7}, 50)
	want := `SELECT id, event_id::text, topic, partition_key, key_hash, payload, metadata, created_at, attempts FROM "s"."outbox" WHERE key_hash % $1 = ANY($2::int[]) AND partition_key <> ALL($3::text[]) AND id <> ALL($4::bigint[]) ORDER BY id LIMIT $5`
	if sql != want || len(args) != 5 || args[0] != 8 || args[4] != 50 {
		t.Fatalf("claim SQL:\n%s\nargs %v\nwant\n%s", sql, args, want)
	}
	if strings.Contains(sql, "FOR UPDATE") || strings.Contains(sql, "xmin") || strings.Contains(sql, "snapshot") {
		t.Fatalf("the claim must read committed rows without locks or snapshot waits: %s", sql)
	}
}

func TestBlockList(t *testing.T) {
	now := time.Now()
	b := newBlockList(100*time.Millisecond, time.Second)
	k := &Message{ID: 1, Key: "K", blockKey: blockKeyOf("K", 1)}
	free := &Message{ID: 2, blockKey: blockKeyOf("", 2)}
	d1 := b.fail(k, 0, now)
	b.fail(free, 0, now)
	keys, ids, next := b.filter(now)
	if len(keys) != 1 || keys[0] != "K" || len(ids) != 1 || ids[0] != 2 || next.IsZero() {
		t.Fatalf("filter = %v %v %v", keys, ids, next)
	}
	d2 := b.fail(k, 0, now)
	if d2 <= d1*5/4 { // doubled, whatever the jitter (±25%)
		t.Fatalf("second failure waits %s, first %s: no exponential growth", d2, d1)
	}
	if d := b.fail(k, 9, now); d < 750*time.Millisecond {
		t.Fatalf("a row with 9 persisted attempts waits %s, want the cap (±25%%)", d)
	}
	keys, ids, _ = b.filter(now.Add(2 * time.Second)) // every wait over
	if len(keys)+len(ids) != 0 {
		t.Fatalf("expired entries still filtered: %v %v", keys, ids)
	}
	b.ok(k)
	if _, ok := b.entries[k.blockKey]; ok {
		t.Fatal("ok did not forget the key")
	}
	b.filter(now.Add(time.Hour)) // long expired entries are dropped
	if len(b.entries) != 0 {
		t.Fatalf("stale entries kept: %d", len(b.entries))
	}
}
