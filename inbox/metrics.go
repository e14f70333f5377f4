package inbox

import (
	"sync/atomic"
	"time"
)

// Metrics receives one call per message the middleware sees. It is a small interface so the
// inbox does not force a metrics library on its users; inbox/inboxprom adapts it to
// Prometheus, and Counters keeps plain totals. Implementations must be safe for concurrent
// use and must not block.
type Metrics interface {
	// Processed: the handler ran and its transaction (dedup row, effect, outgoing events)
	// committed. took is the time from the start of the transaction to the end of the commit.
	Processed(consumer string, took time.Duration)
	// Duplicate: the dedup key was already recorded, so the handler was skipped and the
	// message acknowledged.
	Duplicate(consumer string)
	// Failed: the handler returned an error or panicked, or the transaction could not be
	// begun, written or committed; everything was rolled back and the message goes back to
	// the router as failed.
	Failed(consumer string)
	// NoKey: the message had no usable dedup key (see NoKeyPolicy).
	NoKey(consumer string)
	// Poisoned: a batched consumer gave the message up after its attempts and recorded it in
	// inbox_poison (SettlePoison).
	Poisoned(consumer string)
	// Parked: the message was parked in the retry lane (RetryAfter), at its lane's head or
	// behind an earlier parked message of its key.
	Parked(consumer string)
}

// Counters is a Metrics that keeps totals across all consumers, for tests, demos and
// health pages. The zero value is ready to use.
type Counters struct {
	processed, duplicates, failures, noKeys, poisoned, parked atomic.Int64
}

var _ Metrics = (*Counters)(nil)

// Processed implements Metrics.
func (c *Counters) Processed(string, time.Duration) { c.processed.Add(1) }

// Duplicate implements Metrics.
func (c *Counters) Duplicate(string) { c.duplicates.Add(1) }

// Failed implements Metrics.
func (c *Counters) Failed(string) { c.failures.Add(1) }

// NoKey implements Metrics.
func (c *Counters) NoKey(string) { c.noKeys.Add(1) }

// Poisoned implements Metrics.
func (c *Counters) Poisoned(string) { c.poisoned.Add(1) }

// Parked implements Metrics.
func (c *Counters) Parked(string) { c.parked.Add(1) }

// CountersSnapshot is a point-in-time copy of Counters.
type CountersSnapshot struct {
	Processed  int64 // handler ran and committed
	Duplicates int64 // skipped because the key was already recorded
	Failures   int64 // rolled back and returned as failed
	NoKeys     int64 // refused or dropped for lack of a key
	Poisoned   int64 // given up by a batched consumer and recorded as poison
	Parked     int64 // parked in the retry lane (RetryAfter, or behind a parked message)
}

// Snapshot returns the current totals.
func (c *Counters) Snapshot() CountersSnapshot {
	return CountersSnapshot{
		Processed:  c.processed.Load(),
		Duplicates: c.duplicates.Load(),
		Failures:   c.failures.Load(),
		NoKeys:     c.noKeys.Load(),
		Poisoned:   c.poisoned.Load(),
		Parked:     c.parked.Load(),
	}
}

// NopMetrics discards every measurement. Embed it in your own Metrics implementation so that
// methods added to the interface later do not break it.
type NopMetrics struct{}

var _ Metrics = NopMetrics{}

// Processed implements Metrics.
func (NopMetrics) Processed(string, time.Duration) {}

// Duplicate implements Metrics.
func (NopMetrics) Duplicate(string) {}

// Failed implements Metrics.
func (NopMetrics) Failed(string) {}

// NoKey implements Metrics.
func (NopMetrics) NoKey(string) {}

// Poisoned implements Metrics.
func (NopMetrics) Poisoned(string) {}

// Parked implements Metrics.
func (NopMetrics) Parked(string) {}
