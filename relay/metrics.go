package relay

import "time"

// Metrics receives the relay's measurements. Implementations must be safe for concurrent use
// and fast: they are called on the publishing path. relay/relayprom implements it with
// Prometheus; NopMetrics discards everything.
//
// Embed NopMetrics in an implementation: methods added to Metrics later then keep compiling
// (as no-ops) instead of breaking it.
type Metrics interface {
	// Published is called after every sink call that acknowledged n > 0 messages, with the
	// time the sink call took (the publish latency of the batch).
	Published(n int, took time.Duration)
	// Failed counts messages that were not acknowledged, by kind: FailureUndeliverable (counts
	// toward parking), FailureTransient (retried with backoff), or FailureDatabase for failed
	// relay queries (n = 1 per failed query).
	Failed(kind FailureKind, n int)
	// Parked counts rows moved to outbox_parked.
	Parked(n int)
	// OwnedShards reports how many shard leases this relay holds.
	OwnedShards(n int)
	// Pending reports, every Config.StatsInterval, the rows waiting in the outbox (all
	// shards; exact up to ExactBacklogRows, an estimate above, see Backlog) and the age of the
	// oldest of them (0 when empty).
	Pending(rows int64, oldest time.Duration)
	// ParkedRows reports, with Pending, the rows in outbox_parked (capped at
	// ExactBacklogRows): rows that need an operator (`onceflow outbox parked`).
	ParkedRows(n int64)
	// ScheduledRows reports, with Pending, the messages waiting in outbox_scheduled for their
	// due time (outbox.DeliverAt; exact up to ExactBacklogRows, an estimate above, as
	// ScheduledSummary.Rows) and how many of them are overdue: due more than
	// ScheduledOverdueAfter ago and still not moved into the outbox (counted up to
	// ExactBacklogRows). Any overdue row means no relay moves scheduled messages. Rows
	// scheduled for later are not in Pending: they cost the outbox nothing until they are due.
	ScheduledRows(rows, overdue int64)
	// LeaseRenewal is called after every lease round (renew, acquire, rebalance): ok is
	// false when it failed, and the relay stops publishing at the lease fence if failures go
	// on.
	LeaseRenewal(ok bool)
}

// FailureKind says why messages were not acknowledged, for Metrics.Failed. Its values are
// short lowercase words, usable as a metric label.
type FailureKind string

// Failure kinds passed to Metrics.Failed.
const (
	// FailureUndeliverable: the broker refused the message in a way retrying cannot fix
	// (IsUndeliverable); it counts toward the row's attempt limit and parking.
	FailureUndeliverable FailureKind = "undeliverable"
	// FailureTransient: the broker did not acknowledge (unreachable, timeout, leader change);
	// the rows stay and are retried with backoff, never parked.
	FailureTransient FailureKind = "transient"
	// FailureDatabase: a relay query failed (claim, delete, lease renewal, stats); n is 1.
	FailureDatabase FailureKind = "database"
)

// NopMetrics discards every measurement. It is the default of Config.Metrics, and the type to
// embed in a Metrics implementation that records only some measurements.
type NopMetrics struct{}

var _ Metrics = NopMetrics{}

// Published implements Metrics.
func (NopMetrics) Published(int, time.Duration) {}

// Failed implements Metrics.
func (NopMetrics) Failed(FailureKind, int) {}

// Parked implements Metrics.
func (NopMetrics) Parked(int) {}

// OwnedShards implements Metrics.
func (NopMetrics) OwnedShards(int) {}

// Pending implements Metrics.
func (NopMetrics) Pending(int64, time.Duration) {}

// ParkedRows implements Metrics.
func (NopMetrics) ParkedRows(int64) {}

// ScheduledRows implements Metrics.
func (NopMetrics) ScheduledRows(int64, int64) {}

// LeaseRenewal implements Metrics.
func (NopMetrics) LeaseRenewal(bool) {}
