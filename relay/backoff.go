package relay

import (
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/onceflow/onceflow/internal/failure"
)

// backoffDelay is the wait after the n-th consecutive failure (n ≥ 1): failure.Backoff
// (base·2^(n-1), capped at max), then spread by ±25% jitter (jitter in [0,1)) so relays and
// keys do not retry in step.
func backoffDelay(base, max time.Duration, n int, jitter float64) time.Duration {
	d := failure.Backoff(base, max, n)
	spread := time.Duration(float64(d) * 0.5 * jitter)
	return d - d/4 + spread
}

// maxBlocked caps how many chains are excluded from claims at once; beyond it, failing chains
// are not tracked (their rows are claimed again at once) and the global backoff alone slows
// retries (an outage of the whole broker, not a few bad keys).
const maxBlocked = 10_000

// blockList remembers order chains (keys, or single rows without a key) whose head failed.
// Claims from the cursor exclude them, so every other key keeps flowing and the cursor moves
// on past their rows; when a chain's backoff expires, a retry claim fetches its rows from its
// floor (its first row still pending) up to the cursor. Only the publishing loop uses it.
type blockList struct {
	base, max time.Duration
	entries   map[string]*blockEntry
}

type blockEntry struct {
	key      string // partition key, or "" for a row without one
	id       int64  // the row, when key == ""
	floor    int64  // no row of the chain below this id is still pending
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

// fail records a failure of the chain's head m, the chain's first row still pending. A chain
// already tracked keeps its floor when it is lower: nothing of it was delivered since (that
// forgets the entry), so a row below m may still be pending — m can be the first row this
// batch got to send, not the chain's first (an abandoned send, a row sent alone before it).
// A floor too low costs a longer retry claim; one too high would let m go out before it.
// failures overrides the in-memory count when larger (a row's persisted attempt count survives
// restarts). It returns the wait, or 0 when the list is full and the chain is not tracked.
func (b *blockList) fail(m *Message, failures int, now time.Time) time.Duration {
	e, ok := b.entries[m.blockKey]
	if !ok {
		if len(b.entries) >= maxBlocked {
			return 0
		}
		e = &blockEntry{key: m.Key, id: m.ID, floor: m.ID}
		b.entries[m.blockKey] = e
	}
	e.floor = min(e.floor, m.ID)
	e.failures++
	if failures > e.failures {
		e.failures = failures
	}
	d := backoffDelay(b.base, b.max, e.failures, rand.Float64())
	e.until = now.Add(d)
	return d
}

// holdUntil blocks the chain of m, its first row still pending, until at least until,
// without counting a failure (its topic is closed, see topicGate).
func (b *blockList) holdUntil(m *Message, until time.Time) {
	e, ok := b.entries[m.blockKey]
	if !ok {
		if len(b.entries) >= maxBlocked {
			return
		}
		e = &blockEntry{key: m.Key, id: m.ID, floor: m.ID}
		b.entries[m.blockKey] = e
	}
	e.floor = min(e.floor, m.ID)
	if until.After(e.until) {
		e.until = until
	}
}

// retryAt makes the tracked chain of m due exactly at until (its topic's reopening).
func (b *blockList) retryAt(m *Message, until time.Time) {
	if e, ok := b.entries[m.blockKey]; ok {
		e.until = until
	}
}

// lowerFloor makes a tracked chain start at id at the latest (untracked chains are left
// alone: their rows come through cursor claims).
func (b *blockList) lowerFloor(blockKey string, id int64) {
	if e, ok := b.entries[blockKey]; ok && id < e.floor {
		e.floor = id
	}
}

// ok forgets the chain: its head was delivered or parked.
func (b *blockList) ok(m *Message) { delete(b.entries, m.blockKey) }

// has reports whether the chain is tracked.
func (b *blockList) has(blockKey string) bool { _, ok := b.entries[blockKey]; return ok }

// lowerFloors makes every chain start at id at the latest: rows committed late below the cursor
// may belong to blocked chains.
func (b *blockList) lowerFloors(id int64) {
	for _, e := range b.entries {
		if id < e.floor {
			e.floor = id
		}
	}
}

// blockedSet is what a claim must know about the blocked chains.
type blockedSet struct {
	keys []string // every tracked key: excluded from cursor claims
	ids  []int64  // every tracked keyless row: excluded from cursor claims
	// due are the chains whose wait is over: a retry claim fetches their rows.
	dueKeys []string
	dueIDs  []int64
	floor   int64     // lowest floor among the due chains
	next    time.Time // when the earliest waiting chain becomes due (zero when none waits)
}

func (s blockedSet) anyDue() bool { return len(s.dueKeys)+len(s.dueIDs) > 0 }

// plan splits the tracked chains into waiting and due ones at now.
func (b *blockList) plan(now time.Time) blockedSet {
	var s blockedSet
	for _, e := range b.entries {
		if e.key != "" {
			s.keys = append(s.keys, e.key)
		} else {
			s.ids = append(s.ids, e.id)
		}
		if e.until.After(now) {
			if s.next.IsZero() || e.until.Before(s.next) {
				s.next = e.until
			}
			continue
		}
		if e.key != "" {
			s.dueKeys = append(s.dueKeys, e.key)
		} else {
			s.dueIDs = append(s.dueIDs, e.id)
		}
		if len(s.dueKeys)+len(s.dueIDs) == 1 || e.floor < s.floor {
			s.floor = e.floor
		}
	}
	return s
}

// retried settles the due chains after a retry claim that fetched msgs. done reports the rows
// that left the outbox (delivered or parked). A chain that failed again waits its new backoff;
// one with a fetched row still pending (the batch was abandoned) is retried at once from that
// row; one delivered in full is forgotten when the claim reached the cursor (exhausted), and
// otherwise retried at once from just after the last row fetched.
func (b *blockList) retried(s blockedSet, msgs []*Message, done func(*Message) bool, exhausted bool, now time.Time) {
	var last int64
	open := map[string]int64{} // chain → its first fetched row still pending
	for _, m := range msgs {
		last = max(last, m.ID)
		if _, ok := open[m.blockKey]; !ok && !done(m) {
			open[m.blockKey] = m.ID
		}
	}
	settle := func(bk string, key string, id int64) {
		e, tracked := b.entries[bk]
		if tracked && e.until.After(now) {
			return
		}
		floor, pending := open[bk]
		if !pending {
			if exhausted {
				delete(b.entries, bk)
				return
			}
			floor = last + 1
		}
		if !tracked {
			e = &blockEntry{key: key, id: id}
			b.entries[bk] = e
		}
		e.floor, e.until = floor, now
	}
	for _, k := range s.dueKeys {
		settle(blockKeyOf(k, 0), k, 0)
	}
	for _, id := range s.dueIDs {
		settle(blockKeyOf("", id), "", id)
	}
}
