package relay

import (
	"context"
	"time"

	"github.com/onceflow/onceflow/internal/pgsql"
)

// sampleStats reports the backlog (rows waiting, the age of the oldest, parked rows) and the
// scheduled messages (rows, overdue rows) every StatsInterval. It reads them the cheap way
// (Backlog: endpoint lookups, a count capped at ExactBacklogRows and the statistics counter;
// the scheduled counts: the same on the due index of outbox_scheduled), not with a count(*)
// that would read the whole table every interval of every relay exactly when it is large.
func (r *Relay) sampleStats(ctx context.Context) {
	t := time.NewTicker(r.cfg.StatsInterval)
	defer t.Stop()
	sql := backlogSQL(r.cfg.Schema)
	schedSQL, schedTable := scheduledCountsSQL(r.cfg.Schema), pgsql.Table(r.cfg.Schema, "outbox_scheduled")
	for {
		qctx, cancel := context.WithTimeout(ctx, r.cfg.StatsInterval)
		b, err := readBacklog(qctx, r.pool, sql, r.q.outbox)
		if err == nil {
			r.m.Pending(b.Rows, b.OldestAge())
			r.m.ParkedRows(b.Parked)
			var s ScheduledSummary
			if s, err = readScheduledCounts(qctx, r.pool, schedSQL, schedTable); err == nil {
				r.m.ScheduledRows(s.Rows, s.Overdue)
			}
		}
		cancel()
		if err != nil && ctx.Err() == nil {
			r.m.Failed(FailureDatabase, 1)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
