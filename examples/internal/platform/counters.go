package platform

import (
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/idempotency"
)

// Counter is a set of named totals, safe for concurrent use: what a service shows on
// /debug/counters. A real service would export Prometheus metrics instead (relayprom,
// inboxprom, sagaprom).
type Counter struct {
	mu sync.Mutex
	m  map[string]int64
}

// Add adds n to the total called name.
func (c *Counter) Add(name string, n int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[string]int64{}
	}
	c.m[name] += n
}

// Snapshot returns a copy of the totals.
func (c *Counter) Snapshot() map[string]int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]int64, len(c.m))
	for k, v := range c.m {
		out[k] = v
	}
	return out
}

// HTTPMetrics counts the idempotency middleware's outcomes as "http_<outcome>".
type HTTPMetrics struct{ C *Counter }

// Observe implements idempotency.Metrics.
func (m HTTPMetrics) Observe(o idempotency.Outcome, _ time.Duration) { m.C.Add("http_"+string(o), 1) }

// Count returns a handler that counts every delivery as name before calling h.
func Count(c *Counter, name string, h message.NoPublishHandlerFunc) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		c.Add(name, 1)
		return h(msg)
	}
}
