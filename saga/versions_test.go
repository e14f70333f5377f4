package saga_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

// versionDef is a one-step definition nobody answers: its sagas stay where the test puts them.
func versionDef(name string, version int, mod ...func(*saga.StepDef[Checkout])) *saga.Definition[Checkout] {
	s := saga.Step[Checkout]("reserve").Send(name+".reserve", func(c Checkout) (any, error) { return stepCmd{Order: c.Order}, nil })
	for _, m := range mod {
		m(s)
	}
	return saga.MustDefine(name, version, []*saga.StepDef[Checkout]{s})
}

// startIn starts a saga of def with id and puts it in state, started age ago.
func startIn(t *testing.T, db *testdb.DB, def *saga.Definition[Checkout], id string, state saga.State, age time.Duration) {
	t.Helper()
	ctx := context.Background()
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := saga.StartTx(ctx, tx, def, Checkout{Order: id}, saga.WithID(id), saga.WithWriter(w))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE `+db.Table("saga")+` SET state = $2, created_at = now() - make_interval(secs => $3),
		finished_at = CASE WHEN $2 IN ('completed', 'compensated') THEN now() END WHERE id = $1`, id, string(state), age.Seconds()); err != nil {
		t.Fatal(err)
	}
}

// runningOrchestrator runs an orchestrator with defs registered under consumer until stop,
// which returns once Run has (and so has deleted its saga_orchestrator row).
func runningOrchestrator(t *testing.T, db *testdb.DB, consumer string, log *slog.Logger, defs ...*saga.Definition[Checkout]) (o *saga.Orchestrator, stop func()) {
	t.Helper()
	o, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: db.Pool, Schema: db.Schema, Consumer: consumer,
		TimerInterval: 20 * time.Millisecond, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range defs {
		if err := saga.Register(o, d); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- o.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run of %s returned %v; want nil", consumer, err)
			}
		})
	}
	t.Cleanup(stop)
	return o, stop
}

func versionsAdmin(t *testing.T, db *testdb.DB) *saga.Admin {
	t.Helper()
	a, err := saga.NewAdmin(db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// versionsText is the listing in one comparable line per version:
// "name:version running/compensating/stuck oldest [consumers]".
func versionsText(vs []saga.VersionStatus) string {
	var lines []string
	for _, v := range vs {
		var consumers []string
		for _, o := range v.Orchestrators {
			consumers = append(consumers, o.Consumer)
		}
		slices.Sort(consumers) // same host and pid: their order is their random ids'
		oldest := v.OldestID
		if oldest == "" {
			oldest = "-"
		}
		lines = append(lines, fmt.Sprintf("%s %d/%d/%d %s %v", v.Key(), v.Running, v.Compensating, v.Stuck, oldest, consumers))
	}
	return strings.Join(lines, "\n")
}

// Admin.Versions counts each version's sagas per unfinished state with the oldest, lists the
// live orchestrators that registered it (two with different registrations), includes a
// version only an orchestrator has (no sagas) and one only sagas have (no orchestrator), and
// drops an orchestrator as soon as its Run returns.
func TestVersionsCountsSagasAndOrchestrators(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	co1, co2, refund1, legacy1 := versionDef("checkout", 1), versionDef("checkout", 2), versionDef("refund", 1), versionDef("legacy", 1)
	startIn(t, db, co1, "co1-running", saga.StateRunning, 3*time.Hour)
	startIn(t, db, co1, "co1-compensating", saga.StateCompensating, 2*time.Hour)
	startIn(t, db, co1, "co1-stuck", saga.StateStuck, time.Hour)
	startIn(t, db, co1, "co1-completed", saga.StateCompleted, 5*time.Hour) // older, but finished
	startIn(t, db, co1, "co1-compensated", saga.StateCompensated, 4*time.Hour)
	startIn(t, db, co2, "co2-running", saga.StateRunning, 10*time.Minute)
	startIn(t, db, co2, "co2-new", saga.StateRunning, time.Minute)
	startIn(t, db, refund1, "refund-completed", saga.StateCompleted, time.Hour)
	startIn(t, db, legacy1, "legacy-stuck", saga.StateStuck, 24*time.Hour)

	_, stopA := runningOrchestrator(t, db, "orch-a", nil, co1, co2)
	_, stopB := runningOrchestrator(t, db, "orch-b", nil, co2, refund1)
	admin := versionsAdmin(t, db)
	want := strings.Join([]string{
		"checkout:1 1/1/1 co1-running [orch-a]",
		"checkout:2 2/0/0 co2-running [orch-a orch-b]",
		"legacy:1 0/0/1 legacy-stuck []",
		"refund:1 0/0/0 - [orch-b]",
	}, "\n")
	var got []saga.VersionStatus
	testutil.AwaitWithin(t, 10*time.Second, "both orchestrators listed with their versions", func() bool {
		var err error
		if got, err = admin.Versions(ctx, db.Pool); err != nil {
			t.Fatal(err)
		}
		return versionsText(got) == want
	}, func() string { return "got\n" + versionsText(got) + "\nwant\n" + want })

	host, _ := os.Hostname()
	ids := map[string]string{}
	for _, v := range got {
		if v.NotFinished() != v.Running+v.Compensating+v.Stuck {
			t.Errorf("%s: NotFinished %d", v.Key(), v.NotFinished())
		}
		if v.OldestID != "" && (v.OldestStartedAt.IsZero() || time.Since(v.OldestStartedAt) < time.Minute) {
			t.Errorf("%s: oldest %s started %s; want its created_at", v.Key(), v.OldestID, v.OldestStartedAt)
		}
		for _, o := range v.Orchestrators {
			if o.ID == "" || o.Host != host || o.PID != os.Getpid() || o.StartedAt.IsZero() || o.SeenAt.Before(o.StartedAt) {
				t.Errorf("%s: orchestrator %+v; want an id, this host and pid, started and seen", v.Key(), o)
			}
			if prev, ok := ids[o.Consumer]; ok && prev != o.ID {
				t.Errorf("orchestrator %s listed with ids %s and %s", o.Consumer, prev, o.ID)
			}
			ids[o.Consumer] = o.ID
		}
	}
	if len(ids) != 2 || ids["orch-a"] == ids["orch-b"] {
		t.Errorf("orchestrator ids %v; want two different ones", ids)
	}
	if d := got[0].OldestStartedAt; time.Since(d) < 3*time.Hour-time.Minute || time.Since(d) > 3*time.Hour+time.Minute {
		t.Errorf("checkout:1's oldest started %s ago; want 3h (co1-running), the finished ones older than it do not count", time.Since(d))
	}

	// B stops: its row goes with its Run, at once.
	stopB()
	got, err := admin.Versions(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	want = strings.Join([]string{
		"checkout:1 1/1/1 co1-running [orch-a]",
		"checkout:2 2/0/0 co2-running [orch-a]",
		"legacy:1 0/0/1 legacy-stuck []",
	}, "\n")
	if versionsText(got) != want {
		t.Errorf("after orch-b stopped:\n%s\nwant\n%s", versionsText(got), want)
	}
	stopA()
	var rows int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Table("saga_orchestrator")).Scan(&rows); err != nil || rows != 0 {
		t.Errorf("saga_orchestrator has %d rows (%v) after both orchestrators stopped; want 0", rows, err)
	}
}

// CheckVersions fails, listing every version with sagas not finished (stuck included) that
// the list lacks, with what to do; finished sagas and versions without sagas are not required.
func TestCheckVersions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	co1, co2, refund1 := versionDef("checkout", 1), versionDef("checkout", 2), versionDef("refund", 1)
	startIn(t, db, co1, "co1-a", saga.StateRunning, 2*time.Hour)
	startIn(t, db, co1, "co1-b", saga.StateStuck, time.Hour)
	startIn(t, db, co2, "co2-a", saga.StateRunning, time.Minute)
	startIn(t, db, refund1, "refund-a", saga.StateCompleted, time.Hour)
	startIn(t, db, refund1, "refund-b", saga.StateCompensated, time.Hour)
	admin := versionsAdmin(t, db)

	err := admin.CheckVersions(ctx, db.Pool, saga.VersionsOf(co2))
	var ue *saga.UnregisteredVersionsError
	if !errors.As(err, &ue) || !errors.Is(err, saga.ErrUnregisteredVersions) {
		t.Fatalf("CheckVersions without checkout:1 returned %v; want an *UnregisteredVersionsError", err)
	}
	if len(ue.Missing) != 1 || ue.Missing[0].Key() != (saga.DefinitionVersion{Name: "checkout", Version: 1}) ||
		ue.Missing[0].Running != 1 || ue.Missing[0].Stuck != 1 || ue.Missing[0].OldestID != "co1-a" || ue.Schema != db.Schema {
		t.Errorf("missing %+v in schema %q; want checkout:1 alone, 1 running and 1 stuck, oldest co1-a", ue.Missing, ue.Schema)
	}
	for _, want := range []string{"checkout:1 (2 not finished: 1 running, 0 compensating, 1 stuck; oldest co1-a, started ",
		"`onceflow saga versions` shows no saga not finished for it", "saga.Register", "`onceflow saga retry`"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not say %q:\n%v", want, err)
		}
	}
	if strings.Contains(err.Error(), "refund") {
		t.Errorf("error names refund, whose sagas all finished:\n%v", err)
	}

	// With checkout:1 in the list it passes; refund:1 (only finished sagas) is not required.
	if err := admin.CheckVersions(ctx, db.Pool, saga.VersionsOf(co1, co2)); err != nil {
		t.Errorf("CheckVersions with checkout:1 and 2: %v", err)
	}
	o, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: db.Pool, Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []*saga.Definition[Checkout]{co2, co1} {
		if err := saga.Register(o, d); err != nil {
			t.Fatal(err)
		}
	}
	if got := saga.FormatVersions(o.Registered()); got != "checkout:1,checkout:2" {
		t.Errorf("Registered: %s", got)
	}
	if err := admin.CheckVersions(ctx, db.Pool, o.Registered()); err != nil {
		t.Errorf("CheckVersions with the orchestrator's versions: %v", err)
	}

	// Once checkout:1's sagas finished, a list without it passes.
	if _, err := db.Pool.Exec(ctx, `UPDATE `+db.Table("saga")+` SET state = 'compensated', finished_at = now() WHERE name = 'checkout' AND version = 1`); err != nil {
		t.Fatal(err)
	}
	if err := admin.CheckVersions(ctx, db.Pool, saga.VersionsOf(co2)); err != nil {
		t.Errorf("CheckVersions after checkout:1's sagas finished: %v", err)
	}
	// An empty list fails while any saga is alive.
	err = admin.CheckVersions(ctx, db.Pool, nil)
	if !errors.As(err, &ue) || len(ue.Missing) != 1 || ue.Missing[0].Key().String() != "checkout:2" {
		t.Errorf("CheckVersions with no versions: %v; want checkout:2 missing", err)
	}
}

// A row whose expiry passed (its process died without stopping) counts as gone: Versions does
// not list it, and the next heartbeat of any orchestrator deletes it. A heartbeat refreshes
// the row with the versions registered since, keeping started_at.
func TestStaleOrchestratorIsGone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	orchT := db.Table("saga_orchestrator")
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+orchT+` (id, consumer, host, pid, definitions, started_at, seen_at, expires_at) VALUES
		('crashed', 'onceflow-saga', 'old-host', 7, '[{"name": "legacy", "version": 1}]', now() - interval '1 hour', now() - interval '31 seconds', now() - interval '1 second'),
		('alive', 'onceflow-saga', 'other-host', 8, '[{"name": "checkout", "version": 1}]', now(), now(), now() + interval '30 seconds')`); err != nil {
		t.Fatal(err)
	}
	admin := versionsAdmin(t, db)
	vs, err := admin.Versions(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if got := versionsText(vs); got != "checkout:1 0/0/0 - [onceflow-saga]" || vs[0].Orchestrators[0].ID != "alive" {
		t.Errorf("Versions with a stale row:\n%s\nwant only checkout:1 of the live row", got)
	}

	o, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: db.Pool, Schema: db.Schema, Consumer: "beating"})
	if err != nil {
		t.Fatal(err)
	}
	if err := saga.Register(o, versionDef("checkout", 2)); err != nil {
		t.Fatal(err)
	}
	saga.Beat(ctx, o, "beat-1")
	ids := func() []string {
		rows, err := db.Pool.Query(ctx, `SELECT id FROM `+orchT+` ORDER BY id`)
		if err != nil {
			t.Fatal(err)
		}
		out, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	if got := ids(); !slices.Equal(got, []string{"alive", "beat-1"}) {
		t.Errorf("rows after a heartbeat: %v; want the stale one deleted, the live one kept, the new one added", got)
	}
	row := func() (defs string, started, seen time.Time) {
		if err := db.Pool.QueryRow(ctx, `SELECT definitions::text, started_at, seen_at FROM `+orchT+` WHERE id = 'beat-1'`).Scan(&defs, &started, &seen); err != nil {
			t.Fatal(err)
		}
		return defs, started, seen
	}
	defs1, started1, seen1 := row()
	if err := saga.Register(o, versionDef("checkout", 3)); err != nil {
		t.Fatal(err)
	}
	saga.Beat(ctx, o, "beat-1")
	defs2, started2, seen2 := row()
	var got []saga.DefinitionVersion
	if err := json.Unmarshal([]byte(defs2), &got); err != nil {
		t.Fatal(err)
	}
	if saga.FormatVersions(got) != "checkout:2,checkout:3" || !started2.Equal(started1) || !seen2.After(seen1) {
		t.Errorf("after a second heartbeat: definitions %s (was %s), started %s (was %s), seen %s (was %s); "+
			"want checkout:2 and 3, the same start, a later heartbeat", defs2, defs1, started2, started1, seen2, seen1)
	}
}

// A heartbeat that fails (here its table is gone) is logged and never holds up the timers.
func TestHeartbeatFailureDoesNotStopTimers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	if _, err := db.Pool.Exec(ctx, `DROP TABLE `+db.Table("saga_orchestrator")); err != nil {
		t.Fatal(err)
	}
	def := versionDef("checkout", 1, func(s *saga.StepDef[Checkout]) { s.Attempts(3, time.Millisecond).Timeout(50 * time.Millisecond) })
	startIn(t, db, def, "o-1", saga.StateRunning, 0)
	rec := newRecorder()
	_, stop := runningOrchestrator(t, db, "orch", slog.New(rec), def)
	rec.waitFor(t, "the heartbeat's failure", func(recs []slog.Record) bool {
		for _, r := range recs {
			if r.Level == slog.LevelWarn && strings.Contains(r.Message, "saga_orchestrator") &&
				strings.Contains(attr(r, "err").String(), "onceflow migrate up --schema "+db.Schema) {
				return true
			}
		}
		return false
	})
	admin := versionsAdmin(t, db)
	var d *saga.Detail
	testutil.AwaitWithin(t, 10*time.Second, "the step timeout fires twice (attempt 3)", func() bool {
		var err error
		if d, err = admin.Get(ctx, db.Pool, "o-1"); err != nil {
			t.Fatal(err)
		}
		return d.Attempt >= 3
	}, func() string { return fmt.Sprintf("saga is %s at attempt %d", d.State, d.Attempt) })
	stop()
	if _, err := admin.Versions(ctx, db.Pool); err == nil || !strings.Contains(err.Error(), "onceflow migrate up") {
		t.Errorf("Versions without its table: %v; want the migrate command", err)
	}
}

// Versions reads the sagas that have not finished, not the finished ones retention keeps:
// with 150k finished and 500 running, its plan touches a small part of the table's pages.
func TestVersionsReadOnlyUnfinished(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	for _, sql := range []string{
		`INSERT INTO ` + db.Table("saga") + ` (id, name, version, state, data, steps, created_at, finished_at)
			SELECT 'saga-' || g, 'checkout', 1 + (g / 300) % 3, CASE WHEN g % 300 = 0 THEN 'running' ELSE 'completed' END,
				'{"order": "x"}', '[{"name": "reserve", "status": "done", "attempts": 1}]',
				now() - (150000 - g) * interval '1 second', CASE WHEN g % 300 <> 0 THEN now() END
			FROM generate_series(1, 150000) g`,
		`VACUUM ANALYZE ` + db.Table("saga"),
	} {
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	var plan []struct {
		Plan struct {
			Hit  int64 `json:"Shared Hit Blocks"`
			Read int64 `json:"Shared Read Blocks"`
		} `json:"Plan"`
	}
	var raw []byte
	if err := db.Pool.QueryRow(ctx, `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) `+saga.VersionsSQL(db.Schema)).Scan(&raw); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &plan); err != nil || len(plan) != 1 {
		t.Fatalf("plan %s: %v", raw, err)
	}
	var pages int64
	if err := db.Pool.QueryRow(ctx, `SELECT relpages FROM pg_class WHERE oid = $1::regclass`, db.Table("saga")).Scan(&pages); err != nil {
		t.Fatal(err)
	}
	touched := plan[0].Plan.Hit + plan[0].Plan.Read
	t.Logf("the count touched %d buffers of a %d-page table", touched, pages)
	if touched > pages/4 {
		t.Errorf("the count touched %d buffers of a %d-page table; want those of the 500 running sagas (a few hundred):\n%s", touched, pages, raw)
	}
	vs, err := versionsAdmin(t, db).Versions(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, v := range vs {
		n += v.NotFinished()
	}
	if len(vs) != 3 || n != 500 || vs[0].OldestID != "saga-900" || vs[1].OldestID != "saga-300" {
		t.Errorf("Versions: %s; want 3 versions, 500 running, oldest saga-900 (checkout:1) and saga-300 (checkout:2)", versionsText(vs))
	}
}

func TestParseVersions(t *testing.T) {
	for _, c := range []struct {
		in, want, err string
	}{
		{in: "checkout:1", want: "checkout:1"},
		{in: " checkout:2 , checkout:1,refund:3,checkout:1", want: "checkout:1,checkout:2,refund:3"},
		{in: "billing:v2:4", want: "billing:v2:4"}, // the name ends at the last colon
		{in: "", err: "the version list is empty"},
		{in: "  ", err: "the version list is empty"},
		{in: "checkout", err: `"checkout" has no version`},
		{in: "checkout:0,refund:x,:3,checkout:1", err: `"checkout:0": version "0" is not a positive whole number; "refund:x": version "x" is not a positive whole number; ":3": saga name is empty`},
		{in: "checkout:1,", err: `"" has no version`},
	} {
		got, err := saga.ParseVersions(c.in)
		switch {
		case c.err != "" && (err == nil || !strings.Contains(err.Error(), c.err)):
			t.Errorf("ParseVersions(%q) = %v, %v; want an error with %q", c.in, got, err, c.err)
		case c.err == "" && (err != nil || saga.FormatVersions(got) != c.want):
			t.Errorf("ParseVersions(%q) = %v, %v; want %s", c.in, got, err, c.want)
		}
	}
}

// What ParseVersions accepts, FormatVersions writes back in a form that parses to the same.
func FuzzParseVersions(f *testing.F) {
	for _, s := range []string{"checkout:1", "a:1,b:2", "x:y:3", " a:1 ,a:1", "a:-1", "é:9", ":1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		vs, err := saga.ParseVersions(s)
		if err != nil {
			return
		}
		again, err := saga.ParseVersions(saga.FormatVersions(vs))
		if err != nil || !slices.Equal(again, vs) {
			t.Errorf("%q parsed to %v, formatted %q, parsed again to %v, %v", s, vs, saga.FormatVersions(vs), again, err)
		}
	})
}
