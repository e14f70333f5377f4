package relay

import (
	"context"
	"time"
)

// sampleStats reports the pending rows and the age of the oldest every StatsInterval.
func (r *Relay) sampleStats(ctx context.Context) {
	t := time.NewTicker(r.cfg.StatsInterval)
	defer t.Stop()
	for {
		var rows int64
		var age float64
		qctx, cancel := context.WithTimeout(ctx, r.cfg.StatsInterval)
		err := r.pool.QueryRow(qctx, r.q.stats).Scan(&rows, &age)
		cancel()
		if err == nil {
			r.m.Pending(rows, time.Duration(age*float64(time.Second)))
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
