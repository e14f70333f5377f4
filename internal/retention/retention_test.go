package retention

import (
	"context"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

func TestCheckWindow(t *testing.T) {
	cases := []struct {
		window     time.Duration
		allowShort bool
		wantErr    string
	}{
		{72 * time.Hour, false, ""},
		{24 * time.Hour, false, ""},
		{23 * time.Hour, false, "under the 24h0m0s minimum"},
		{time.Hour, true, ""},
		{0, true, "must be positive"},
		{-time.Hour, false, "must be positive"},
	}
	for _, c := range cases {
		err := CheckWindow("Retention", c.window, c.allowShort)
		if c.wantErr == "" && err != nil || c.wantErr != "" && (err == nil || !strings.Contains(err.Error(), c.wantErr)) {
			t.Errorf("CheckWindow(%s, %v) = %v, want %q", c.window, c.allowShort, err, c.wantErr)
		}
	}
}

func TestDailyAt(t *testing.T) {
	d := DailyAt(3 * time.Hour)
	cases := []struct{ now, want string }{
		{"2026-11-30T02:59:00Z", "2026-11-30T03:00:00Z"},
		{"2026-11-30T03:00:00Z", "2026-12-01T03:00:00Z"},
		{"2026-11-30T23:00:00Z", "2026-12-01T03:00:00Z"},
	}
	for _, c := range cases {
		now, _ := time.Parse(time.RFC3339, c.now)
		if got := d.Next(now).Format(time.RFC3339); got != c.want {
			t.Errorf("Next(%s) = %s, want %s", c.now, got, c.want)
		}
	}
}

type fakeExec struct{ remaining, calls int64 }

func (f *fakeExec) Exec(_ context.Context, _ string, args ...any) (pgconn.CommandTag, error) {
	f.calls++
	limit := int64(args[len(args)-1].(int))
	n := min(limit, f.remaining)
	f.remaining -= n
	return pgconn.NewCommandTag("DELETE " + strconv.FormatInt(n, 10)), nil
}

func TestDeleteInBatchesStopsOnShortBatch(t *testing.T) {
	f := &fakeExec{remaining: 2500}
	n, err := DeleteInBatches(context.Background(), f, "DELETE", 1000)
	if err != nil || n != 2500 || f.calls != 3 {
		t.Fatalf("deleted %d in %d calls (err %v), want 2500 in 3", n, f.calls, err)
	}
}

func TestRunCallsCleanerOnSchedule(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var calls atomic.Int32
	done := make(chan error)
	go func() {
		done <- Run(ctx, Every(time.Millisecond), nil, func(context.Context) (int64, error) {
			if calls.Add(1) == 3 {
				cancel()
			}
			return 0, nil
		})
	}()
	if err := <-done; err != context.Canceled || calls.Load() < 3 {
		t.Fatalf("Run = %v after %d calls", err, calls.Load())
	}
}
