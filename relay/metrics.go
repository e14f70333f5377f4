package relay

import "time"

// Metrics receives the relay's measurements. Implementations must be safe for concurrent use
// and fast: they are called on the publishing path. relay/relayprom implements it with
// Prometheus; NopMetrics discards everything.
type Metrics interface {
	// Published is called after every sink call that acknowledged n > 0 messages, with the
	// time the sink call took (the publish latency of the batch).
	Published(n int, took time.Duration)
	// Failed counts messages that were not acknowledged, by kind: "permanent" (counts toward
	// parking), "transient" (retried with backoff) or "database" for failed relay queries
	// (n = 1 per failed query).
	Failed(kind string, n int)
	// Parked counts rows moved to outbox_parked.
	Parked(n int)
	// OwnedShards reports how many shard leases this relay holds.
	OwnedShards(n int)
	// Pending reports, every Config.StatsInterval, the rows waiting in the outbox (all
	// shards) and the age of the oldest of them (0 when empty).
	Pending(rows int64, oldest time.Duration)
}

// Failure kinds passed to Metrics.Failed.
const (
	FailPermanent = "permanent"
	FailTransient = "transient"
	FailDatabase  = "database"
)

// NopMetrics discards every measurement.
type NopMetrics struct{}

// Published implements Metrics.
func (NopMetrics) Published(int, time.Duration) {}

// Failed implements Metrics.
func (NopMetrics) Failed(string, int) {}

// Parked implements Metrics.
func (NopMetrics) Parked(int) {}

// OwnedShards implements Metrics.
func (NopMetrics) OwnedShards(int) {}

// Pending implements Metrics.
func (NopMetrics) Pending(int64, time.Duration) {}
