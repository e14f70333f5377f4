package retention

import (
	"context"
	"errors"
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
		{23 * time.Hour, false, "under the 24h0m0s minimum: records deleted too early let late redeliveries or retries run again; raise it, or set AllowShortWindow"},
		{time.Hour, true, ""},
		{0, true, "must be positive"},
		{-time.Hour, false, "must be positive"},
	}
	for _, c := range cases {
		err := CheckWindow("Window", c.window, c.allowShort, "AllowShortWindow")
		if c.wantErr == "" && err != nil || c.wantErr != "" && (err == nil || !strings.Contains(err.Error(), c.wantErr)) {
			t.Errorf("CheckWindow(%s, %v) = %v, want %q", c.window, c.allowShort, err, c.wantErr)
		}
	}
}

func TestCheckSchedule(t *testing.T) {
	cases := []struct {
		s       Schedule
		wantErr string
	}{
		{nil, "nil"},
		{every(time.Second), ""},
		{bad{}, "cannot run"},
	}
	for _, c := range cases {
		err := CheckSchedule(c.s)
		if c.wantErr == "" && err != nil || c.wantErr != "" && (err == nil || !strings.Contains(err.Error(), c.wantErr)) {
			t.Errorf("CheckSchedule(%v) = %v, want %q", c.s, err, c.wantErr)
		}
	}
	if err := Run(context.Background(), bad{}, nil, nil); err == nil || !strings.Contains(err.Error(), "cannot run") {
		t.Errorf("Run with an invalid schedule = %v, want the schedule's error at once", err)
	}
}

// every is a test schedule (the real ones are in the public retention package, which
// internal/ must not import).
type every time.Duration

func (e every) Next(now time.Time) time.Time { return now.Add(time.Duration(e)) }

// bad is a schedule whose Validate refuses it.
type bad struct{}

func (bad) Next(now time.Time) time.Time { return now }
func (bad) Validate() error              { return errors.New("cannot run") }

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
		done <- Run(ctx, every(time.Millisecond), nil, func(context.Context) (int64, error) {
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

// A run cut short by ctx ends Run with ctx's error, without waiting for the next time.
func TestRunStopsWhenCancelledMidRun(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	err := Run(ctx, every(time.Millisecond), nil, func(ctx context.Context) (int64, error) {
		cancel()
		return 0, ctx.Err()
	})
	if err != context.Canceled {
		t.Fatalf("Run = %v, want context.Canceled", err)
	}
}
