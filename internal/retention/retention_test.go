package retention

import (
	"context"
	"errors"
	"go/parser"
	"go/token"
	"log/slog"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/retention"
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
		s       retention.Schedule
		wantErr string
	}{
		{nil, "nil"},
		{retention.Every(time.Second), ""},
		{retention.Every(0), "must be positive"},
		{retention.DailyAt(24, 0), "want hour 0-23"},
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
		done <- Run(ctx, retention.Every(time.Millisecond), nil, func(context.Context) (int64, error) {
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
	err := Run(ctx, retention.Every(time.Millisecond), nil, func(ctx context.Context) (int64, error) {
		cancel()
		return 0, ctx.Err()
	})
	if err != context.Canceled {
		t.Fatalf("Run = %v, want context.Canceled", err)
	}
}

// The fields every cleaner shares get their defaults in one place; what is still invalid is
// reported per field, all at once.
func TestCleanerFieldsDefaults(t *testing.T) {
	var (
		schema string
		batch  int
		sched  retention.Schedule
		logger *slog.Logger
		window time.Duration
	)
	f := CleanerFields{Schema: &schema, BatchSize: &batch, Schedule: &sched, Logger: &logger, Window: &window, DefaultWindow: 72 * time.Hour}
	if problems := f.Defaults(); len(problems) != 0 {
		t.Fatalf("defaults refused: %v", problems)
	}
	if schema != pgsql.DefaultSchema || batch != retention.DefaultBatchSize || sched != retention.DefaultSchedule || logger == nil || window != 72*time.Hour {
		t.Fatalf("defaults: schema %q, batch %d, schedule %v, logger %v, window %v", schema, batch, sched, logger, window)
	}

	schema, batch, sched, window = "Bad-Schema", -1, retention.Every(0), time.Hour
	problems := f.Defaults()
	want := []string{"Schema:", "Window is 1h0m0s, under the 24h0m0s minimum", "BatchSize is -1", "Schedule: Every(0s)"}
	if len(problems) != len(want) {
		t.Fatalf("problems = %v, want %d", problems, len(want))
	}
	for i, w := range want {
		if !strings.Contains(problems[i].Error(), w) {
			t.Errorf("problem %d = %q, want it to contain %q", i, problems[i], w)
		}
	}
	f.AllowShortWindow = true
	if problems := f.Defaults(); len(problems) != 3 {
		t.Errorf("AllowShortWindow: problems = %v, want the window accepted", problems)
	}

	// A cleaner without a window of its own (idempotency's) passes no Window.
	schema, batch, sched = "", 0, nil
	f = CleanerFields{Schema: &schema, BatchSize: &batch, Schedule: &sched, Logger: &logger}
	if problems := f.Defaults(); len(problems) != 0 {
		t.Fatalf("no window: %v", problems)
	}
}

// The public retention package is the leaf vocabulary internal/ may import: it must import
// nothing of onceflow's, or internal/ and the public packages would form a cycle.
func TestPublicRetentionIsALeaf(t *testing.T) {
	files, err := filepath.Glob("../../retention/*.go")
	if err != nil || len(files) == 0 {
		t.Fatalf("no public retention sources (%v)", err)
	}
	for _, file := range files {
		if strings.HasSuffix(file, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), file, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range f.Imports {
			if path := strings.Trim(imp.Path.Value, `"`); strings.HasPrefix(path, "github.com/onceflow/onceflow/") {
				t.Errorf("%s imports %s: the public retention package must stay a leaf", file, path)
			}
		}
	}
}
