package relay

import (
	"context"
	"time"
)

// sampleStats reports the backlog (rows waiting, the age of the oldest, parked rows) every
// StatsInterval. It reads them the cheap way (Backlog: endpoint lookups, a count capped at
// ExactBacklogRows and the statistics counter), not with a count(*) that would read the
// whole outbox every interval of every relay exactly when the outbox is large.
func (r *Relay) sampleStats(ctx context.Context) {
	t := time.NewTicker(r.cfg.StatsInterval)
	defer t.Stop()
	sql := backlogSQL(r.cfg.Schema)
	for {
		qctx, cancel := context.WithTimeout(ctx, r.cfg.StatsInterval)
		b, err := readBacklog(qctx, r.pool, sql, r.q.outbox)
		cancel()
		if err == nil {
			r.m.Pending(b.Rows, b.OldestAge())
			r.m.ParkedRows(b.Parked)
		} else if ctx.Err() == nil {
			r.m.Failed(FailureDatabase, 1)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
