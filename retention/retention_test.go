package retention_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	cleaning "github.com/onceflow/onceflow/internal/retention"
	"github.com/onceflow/onceflow/retention"
)

func TestSchedules(t *testing.T) {
	cases := []struct {
		name string
		s    retention.Schedule
		now  string
		want string
	}{
		{"daily before the time", retention.DailyAt(3, 0), "2026-11-30T02:59:00Z", "2026-11-30T03:00:00Z"},
		{"daily at the time: tomorrow", retention.DailyAt(3, 0), "2026-11-30T03:00:00Z", "2026-12-01T03:00:00Z"},
		{"daily after the time, across a month", retention.DailyAt(3, 0), "2026-11-30T23:00:00Z", "2026-12-01T03:00:00Z"},
		{"daily with minutes", retention.DailyAt(14, 30), "2026-06-01T14:29:59Z", "2026-06-01T14:30:00Z"},
		{"midnight is DailyAt(0, 0)", retention.DailyAt(0, 0), "2026-11-30T23:59:00Z", "2026-12-01T00:00:00Z"},
		{"midnight at midnight: tomorrow", retention.DailyAt(0, 0), "2026-12-31T00:00:00Z", "2027-01-01T00:00:00Z"},
		{"last minute of the day", retention.DailyAt(23, 59), "2026-02-28T23:59:30Z", "2026-03-01T23:59:00Z"},
		{"daily is UTC whatever now's zone", retention.DailyAt(3, 0), "2026-11-30T04:00:00+02:00", "2026-11-30T03:00:00Z"},
		{"default is daily 03:00 UTC", retention.DefaultSchedule, "2026-11-30T12:00:00Z", "2026-12-01T03:00:00Z"},
		{"every", retention.Every(90 * time.Minute), "2026-11-30T23:00:00Z", "2026-12-01T00:30:00Z"},
	}
	for _, c := range cases {
		now, err := time.Parse(time.RFC3339, c.now)
		if err != nil {
			t.Fatal(err)
		}
		if got := c.s.Next(now).UTC().Format(time.RFC3339); got != c.want {
			t.Errorf("%s: %v.Next(%s) = %s, want %s", c.name, c.s, c.now, got, c.want)
		}
		if err := cleaning.CheckSchedule(c.s); err != nil {
			t.Errorf("%s: valid schedule %v refused: %v", c.name, c.s, err)
		}
	}
}

func TestInvalidSchedulesAreRefused(t *testing.T) {
	cases := []struct {
		s    retention.Schedule
		want string
	}{
		{retention.Every(0), "Every(0s): the interval must be positive"},
		{retention.Every(-time.Second), "Every(-1s)"},
		{retention.DailyAt(24, 0), "DailyAt(24, 0): want hour 0-23 and minute 0-59 (UTC); midnight is DailyAt(0, 0)"},
		{retention.DailyAt(-1, 0), "DailyAt(-1, 0)"},
		{retention.DailyAt(3, 60), "DailyAt(3, 60)"},
	}
	for _, c := range cases {
		err := cleaning.CheckSchedule(c.s)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("CheckSchedule(%v) = %v, want %q", c.s, err, c.want)
		}
		c.s.Next(time.Now()) // an invalid schedule does not panic
	}
}

func TestParseDailyAt(t *testing.T) {
	cases := []struct {
		in, want string // want: the schedule's String, or "error"
	}{
		{"03:00", "DailyAt(03:00 UTC)"},
		{"00:00", "DailyAt(00:00 UTC)"},
		{"23:59", "DailyAt(23:59 UTC)"},
		{"7:05", "DailyAt(07:05 UTC)"},
		{"24:00", "error"},
		{"12:60", "error"},
		{"3h", "error"},
		{"", "error"},
		{"03:00:00", "error"},
	}
	for _, c := range cases {
		s, err := retention.ParseDailyAt(c.in)
		got := "error"
		if err == nil {
			got = fmt.Sprint(s)
		} else if !strings.Contains(err.Error(), "HH:MM") {
			t.Errorf("ParseDailyAt(%q) error %q does not say the expected form", c.in, err)
		}
		if got != c.want {
			t.Errorf("ParseDailyAt(%q) = %s (%v), want %s", c.in, got, err, c.want)
		}
	}
}

func ExampleDailyAt() {
	now := time.Date(2026, 11, 30, 22, 15, 0, 0, time.UTC)
	fmt.Println(retention.DailyAt(0, 0).Next(now))   // midnight
	fmt.Println(retention.DefaultSchedule.Next(now)) // 03:00 UTC
	// Output:
	// 2026-12-01 00:00:00 +0000 UTC
	// 2026-12-01 03:00:00 +0000 UTC
}

func ExampleParseDailyAt() {
	s, err := retention.ParseDailyAt("04:30")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(s)
	_, err = retention.ParseDailyAt("24:00")
	fmt.Println(err)
	// Output:
	// DailyAt(04:30 UTC)
	// retention: "24:00" is not a UTC time of day HH:MM from 00:00 (midnight) to 23:59, e.g. 03:00
}
