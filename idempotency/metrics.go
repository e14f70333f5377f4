package idempotency

import "time"

// NopMetrics discards every observation; it is the default Config.Metrics. Embed it in your
// own Metrics implementation so that methods added to the interface later do not break it.
type NopMetrics struct{}

var _ Metrics = NopMetrics{}

// Observe implements Metrics.
func (NopMetrics) Observe(Outcome, time.Duration) {}
