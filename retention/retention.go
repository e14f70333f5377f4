// Package retention is the vocabulary onceflow's cleaners and retention windows share: when a
// cleaner runs (Schedule, Every, DailyAt, DefaultSchedule) and the limits every window obeys
// (MinWindow, DefaultBatchSize).
//
// The cleaners are inbox.Cleaner (processed_event), idempotency.Cleaner
// (idempotency_record) and saga.Cleaner (finished sagas); each takes a CleanerConfig of the
// same shape, Clean(ctx) for one pass and Run(ctx) to keep cleaning on
// CleanerConfig.Schedule.
//
// This package is a leaf: it imports nothing of onceflow's, so onceflow's internal engine
// imports it and every value here is written once. The windows are
// inbox.CleanerConfig.Window, idempotency.Config.Window and redisdedup.Config.Window, each
// with an AllowShortWindow override for values under MinWindow and a package DefaultWindow.
package retention

import (
	"fmt"
	"time"
)

// MinWindow is the shortest retention window accepted without an explicit AllowShortWindow:
// a dedup or idempotency record must outlive every realistic redelivery or client retry.
const MinWindow = 24 * time.Hour

// DefaultBatchSize is the default CleanerConfig.BatchSize: the rows one delete statement
// removes, and so locks, at most.
const DefaultBatchSize = 1000

// Schedule says when a cleaner runs next. Every and DailyAt cover the usual cases; any type
// with this method works too.
//
// A Schedule may also have a Validate() error method. The cleaners' constructors call it, so
// an impossible schedule (Every(0), DailyAt(24, 0)) is refused with the rest of the config
// instead of misbehaving later.
type Schedule interface {
	// Next returns the first time after now at which the cleaner runs.
	Next(now time.Time) time.Time
}

// DefaultSchedule is what the cleaners use when CleanerConfig.Schedule is nil: once a day at
// 03:00 UTC, when most services are quiet.
var DefaultSchedule = DailyAt(3, 0)

// Every returns a Schedule that runs every d, the first time d after the cleaner starts.
// d must be positive; the cleaners refuse Every(0) and negative intervals.
func Every(d time.Duration) Schedule { return every{d} }

type every struct{ d time.Duration }

func (e every) Next(now time.Time) time.Time { return now.Add(e.d) }

func (e every) Validate() error {
	if e.d <= 0 {
		return fmt.Errorf("%s: the interval must be positive, e.g. retention.Every(time.Hour)", e)
	}
	return nil
}

func (e every) String() string { return fmt.Sprintf("Every(%s)", e.d) }

// DailyAt returns a Schedule that runs once a day at hour:minute UTC. DailyAt(0, 0) is
// midnight. hour must be 0 to 23 and minute 0 to 59; the cleaners refuse other values.
func DailyAt(hour, minute int) Schedule { return daily{hour, minute} }

type daily struct{ hour, minute int }

func (d daily) Next(now time.Time) time.Time {
	now = now.UTC()
	next := time.Date(now.Year(), now.Month(), now.Day(), d.hour, d.minute, 0, 0, time.UTC)
	if !next.After(now) {
		next = next.AddDate(0, 0, 1) // UTC has no DST: AddDate keeps the time of day
	}
	return next
}

func (d daily) Validate() error {
	if d.hour < 0 || d.hour > 23 || d.minute < 0 || d.minute > 59 {
		return fmt.Errorf("DailyAt(%d, %d): want hour 0-23 and minute 0-59 (UTC); midnight is DailyAt(0, 0)", d.hour, d.minute)
	}
	return nil
}

func (d daily) String() string { return fmt.Sprintf("DailyAt(%02d:%02d UTC)", d.hour, d.minute) }

// ParseDailyAt parses a UTC time of day written HH:MM ("03:00", "00:00" for midnight, up to
// "23:59") into DailyAt, for flags and environment variables.
func ParseDailyAt(s string) (Schedule, error) {
	t, err := time.Parse("15:04", s)
	if err != nil {
		return nil, fmt.Errorf("retention: %q is not a UTC time of day HH:MM from 00:00 (midnight) to 23:59, e.g. 03:00", s)
	}
	return DailyAt(t.Hour(), t.Minute()), nil
}
