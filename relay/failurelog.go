package relay

import (
	"cmp"
	"log/slog"
	"slices"
	"strings"
	"time"
)

// failureLog turns publish failures into a few log lines an operator can read: the first
// failure after a quiet spell is logged at once (warn), later ones are counted and summed up
// once per Config.FailureLogInterval — what failed (topic and error), how often, how many rows
// and the age of the oldest failing row — and the end of a failing spell is logged too. Each
// failure is also logged at debug level. Only the publishing loop uses it.
type failureLog struct {
	log   *slog.Logger
	every time.Duration

	failing   bool      // a spell of failures is going on
	since     time.Time // when the spell began
	lastLine  time.Time // when the last summary (or the first line) was logged
	causes    map[failureCause]int
	total     int       // failures since lastLine
	spell     int       // failures since the spell began
	oldest    time.Time // created_at of the oldest failing row since lastLine
	undeliver int       // of total: undeliverable (counted toward parking)
}

type failureCause struct{ topic, err string }

func newFailureLog(log *slog.Logger, every time.Duration) *failureLog {
	return &failureLog{log: log, every: every, causes: map[failureCause]int{}}
}

// add records one failed row.
func (f *failureLog) add(m *Message, err error, undeliverable bool, now time.Time) {
	f.log.Debug("relay: publish failed, will retry", "id", m.ID, "event_id", m.EventID, "topic", m.Topic, "key", m.Key,
		"attempts", m.Attempts, "undeliverable", undeliverable, "err", err)
	msg := errString(err)
	if i := strings.IndexByte(msg, '\n'); i >= 0 {
		msg = msg[:i]
	}
	f.causes[failureCause{m.Topic, msg}]++
	f.total++
	f.spell++
	if undeliverable {
		f.undeliver++
	}
	if f.oldest.IsZero() || m.CreatedAt.Before(f.oldest) {
		f.oldest = m.CreatedAt
	}
	if !f.failing {
		f.failing, f.since = true, now
		f.line("relay: publishing failed; the rows stay in the outbox and are retried with backoff (a summary follows while it keeps failing)", now)
	}
}

// tick logs the summary when it is due, and the end of a spell after a batch with no
// failure. blocked is the number of chains (keys) currently waiting.
func (f *failureLog) tick(ok bool, blocked int, now time.Time) {
	switch {
	case !f.failing:
	case f.total > 0 && now.Sub(f.lastLine) >= f.every:
		f.line("relay: publishing keeps failing", now, "blocked_keys", blocked)
	case ok && f.total == 0 && blocked == 0:
		f.log.Info("relay: publishing recovered", "failures", f.spell, "after", now.Sub(f.since).Round(time.Millisecond))
		f.failing, f.spell = false, 0
	}
}

// line logs what was gathered since the last line and starts a new window.
func (f *failureLog) line(msg string, now time.Time, extra ...any) {
	type cause struct {
		failureCause
		n int
	}
	var cs []cause
	for c, n := range f.causes {
		cs = append(cs, cause{c, n})
	}
	slices.SortFunc(cs, func(a, b cause) int {
		return cmp.Or(cmp.Compare(b.n, a.n), cmp.Compare(a.topic, b.topic), cmp.Compare(a.err, b.err))
	})
	attrs := []any{"failures", f.total, "undeliverable", f.undeliver, "window", now.Sub(f.lastLine).Round(time.Millisecond)}
	if f.lastLine.IsZero() || f.lastLine.Before(f.since) {
		attrs = attrs[:4] // the first line: no window yet
	}
	if !f.oldest.IsZero() {
		attrs = append(attrs, "oldest_failing_row_age", now.Sub(f.oldest).Round(time.Millisecond))
	}
	const shown = 5
	for i, c := range cs {
		if i == shown {
			attrs = append(attrs, "more_causes", len(cs)-shown)
			break
		}
		attrs = append(attrs, slog.Group("cause"+string(rune('1'+i)), "topic", c.topic, "count", c.n, "err", c.err))
	}
	f.log.Warn(msg, append(attrs, extra...)...)
	clear(f.causes)
	f.total, f.undeliver, f.oldest, f.lastLine = 0, 0, time.Time{}, now
}
