package saga_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/saga"
)

// localChildEnv makes this test binary run an orchestrator whose local step "place" writes
// its effect, prints "IN-STEP <txid>" and then hangs until the process is killed.
const localChildEnv = "ONCEFLOW_SAGA_TEST_LOCAL_CHILD"

func init() {
	if os.Getenv(localChildEnv) != "" {
		os.Exit(localChildMain())
	}
}

func localChildMain() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "child:", err); return 1 }
	pool, err := pgxpool.New(ctx, os.Getenv("CHILD_DB_URL"))
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	schema := os.Getenv("CHILD_SCHEMA")
	build := func(c Checkout) (any, error) { return stepCmd{Order: c.Order}, nil }
	none := func(context.Context, pgx.Tx, *Checkout) error { return nil }
	def := saga.MustDefine("checkout", 1, []*saga.StepDef[Checkout]{
		saga.Step[Checkout]("place").Local(func(ctx context.Context, tx pgx.Tx, c *Checkout) error {
			var txid int64
			if err := tx.QueryRow(ctx, `INSERT INTO `+schema+`.effect (saga, step, phase) VALUES ($1, 'place', 'action')
				RETURNING txid_current()`, c.Order).Scan(&txid); err != nil {
				return err
			}
			fmt.Println("IN-STEP", txid)
			<-ctx.Done() // killed in here
			return ctx.Err()
		}).CompensateLocal(none).Attempts(3, 10*time.Millisecond),
		saga.Step[Checkout]("reserve").Send("cmd.reserve", build).Compensate("undo.reserve", build).Attempts(3, 10*time.Millisecond),
	})
	o, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: pool, Schema: schema, TimerInterval: 20 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, nil))})
	if err != nil {
		return fail(err)
	}
	if err := saga.Register(o, def); err != nil {
		return fail(err)
	}
	fmt.Println("READY")
	if err := o.Run(ctx); err != nil {
		return fail(err)
	}
	return 0
}

// The orchestrator process is SIGKILLed while a local step runs, after the step's write: the
// write dies with the transition (no effect, the saga still at the step, its run not counted),
// and the next orchestrator runs the step once and goes on.
func TestLocalStepOrchestratorKilled(t *testing.T) {
	t.Parallel()
	w := newLocalWorld(t, false, []string{"+place", "reserve"}, nil)
	lines := make(chan string, 10)
	child := testutil.StartChild(t, []string{localChildEnv + "=1", "CHILD_DB_URL=" + w.db.URL, "CHILD_SCHEMA=" + w.db.Schema},
		func(line string) { lines <- line })
	next := func() string {
		t.Helper()
		select {
		case l := <-lines:
			return l
		case <-child.Exited:
			t.Fatalf("child exited; stderr:\n%s", child.Stderr.String())
		case <-time.After(30 * time.Second):
			t.Fatalf("child silent; stderr:\n%s", child.Stderr.String())
		}
		return ""
	}
	if l := next(); l != "READY" {
		t.Fatalf("child said %q", l)
	}
	id := w.start("o-kill") // the child's Run fires the local first step's timer
	l := next()
	killedTx, err := strconv.ParseInt(strings.TrimPrefix(l, "IN-STEP "), 10, 64)
	if err != nil {
		t.Fatalf("child said %q", l)
	}
	if err := child.Cmd.Process.Kill(); err != nil { // the child this test started
		t.Fatal(err)
	}
	child.WaitExit(t, 30*time.Second)
	if !child.KilledBySIGKILL() {
		t.Fatalf("child was not killed: %v", child.Cmd.ProcessState)
	}
	// The killed transaction is gone once the server noticed the dead connection.
	var state string
	for {
		err := w.db.Pool.QueryRow(context.Background(), `SELECT txid_status($1)`, killedTx).Scan(&state)
		if err != nil {
			t.Fatal(err)
		}
		if state != "in progress" {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	d := w.get(id)
	if state != "aborted" || len(w.effects(id)) != 0 || d.Steps[0].Status != "pending" || d.Steps[0].Attempts != 0 || len(d.Timers) != 1 {
		t.Fatalf("after the kill: transaction %s, effects %v, place %+v, timers %v", state, w.effects(id), d.Steps[0], d.Timers)
	}
	d = w.runUntil(id, saga.StateCompleted, saga.StateCompensated)
	if got, want := w.effects(id), []string{"place/action", "reserve/action"}; d.State != saga.StateCompleted || !slices.Equal(got, want) {
		t.Fatalf("%s (%s): effects %v, want %v", d.State, d.Error, got, want)
	}
	if d.Steps[0].Attempts != 1 || w.calls["place/action"] != 1 {
		t.Fatalf("place: %+v, ran %d times here", d.Steps[0], w.calls["place/action"])
	}
}
