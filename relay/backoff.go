package relay

import (
	"math/rand/v2"
	"strconv"
	"time"
)

// backoffDelay is the wait after the n-th consecutive failure (n ≥ 1): base·2^(n-1), capped at
// max, then spread by ±25% jitter (jitter in [0,1)) so relays and keys do not retry in step.
func backoffDelay(base, max time.Duration, n int, jitter float64) time.Duration {
	if n < 1 {
		n = 1
	}
	d := base
	for i := 1; i < n && d < max; i++ {
		d *= 2
	}
	if d > max {
		d = max
	}
	spread := time.Duration(float64(d) * 0.5 * jitter)
	return d - d/4 + spread
}

// maxBlocked caps how many keys are excluded from claims at once; beyond it, failing keys are
// not tracked and the global backoff alone slows retries (an outage of the whole broker, not a
// few bad keys).
const maxBlocked = 10_000

// blockList remembers order chains (keys, or single rows without a key) whose head failed, so
// claims skip them until their backoff expires while every other key keeps flowing. Only the
// publishing loop uses it.
type blockList struct {
	base, max time.Duration
	entries   map[string]*blockEntry
}

type blockEntry struct {
	key      string // partition key, or "" for a row without one
	id       int64  // the row, when key == ""
	until    time.Time
	failures int
}

func newBlockList(base, max time.Duration) *blockList {
	return &blockList{base: base, max: max, entries: map[string]*blockEntry{}}
}

// blockKeyOf is the order chain of a row: its partition key, or its own id when it has none.
func blockKeyOf(key string, id int64) string {
	if key != "" {
		return "k" + key
	}
	return "i" + strconv.FormatInt(id, 10)
}

// fail records a failure of the chain's head. failures overrides the in-memory count when
// larger (a row's persisted attempt count survives restarts). It returns the wait.
func (b *blockList) fail(m *Message, failures int, now time.Time) time.Duration {
	e, ok := b.entries[m.blockKey]
	if !ok {
		if len(b.entries) >= maxBlocked {
			return 0
		}
		e = &blockEntry{key: m.Key, id: m.ID}
		b.entries[m.blockKey] = e
	}
	e.failures++
	if failures > e.failures {
		e.failures = failures
	}
	d := backoffDelay(b.base, b.max, e.failures, rand.Float64())
	e.until = now.Add(d)
	return d
}

// ok forgets the chain: its head was delivered or parked.
func (b *blockList) ok(m *Message) { delete(b.entries, m.blockKey) }

// filter returns the keys and ids to exclude from the next claim and when the earliest of
// them becomes eligible again (zero when none is blocked). Entries long past their wait are
// dropped so keys that moved to another relay or vanished do not accumulate.
func (b *blockList) filter(now time.Time) (keys []string, ids []int64, next time.Time) {
	for bk, e := range b.entries {
		if !e.until.After(now) {
			if now.Sub(e.until) > 2*b.max+time.Minute {
				delete(b.entries, bk)
			}
			continue
		}
		if e.key != "" {
			keys = append(keys, e.key)
		} else {
			ids = append(ids, e.id)
		}
		if next.IsZero() || e.until.Before(next) {
			next = e.until
		}
	}
	return keys, ids, next
}
