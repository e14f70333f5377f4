package saga_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
	"github.com/onceflow/onceflow/saga/sagatest"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// Checkout is the saga data of the tests' three-step saga.
type Checkout struct {
	Order         string `json:"order"`
	Amount        int    `json:"amount"`
	ReservationID string `json:"reservation_id,omitempty"`
	PaymentID     string `json:"payment_id,omitempty"`
}

type stepCmd struct {
	Order string `json:"order"`
}

type stepResult struct {
	ID string `json:"id"`
}

var stepNames = []string{"reserve", "charge", "confirm"}

// checkoutDef is reserve (compensated by release) → charge (refund) → confirm (cancel).
// t may be nil (in a child process): an invalid definition panics then.
func checkoutDef(t testing.TB, mod func(name string, s *saga.StepDef[Checkout]), opts ...saga.Option) *saga.Definition[Checkout] {
	var steps []*saga.StepDef[Checkout]
	for _, name := range stepNames {
		s := checkoutStep(name)
		if mod != nil {
			mod(name, s)
		}
		steps = append(steps, s)
	}
	def, err := saga.Define("checkout", 1, steps, opts...)
	if err != nil {
		if t == nil {
			panic(err)
		}
		t.Fatal(err)
	}
	return def
}

// checkoutStep is a step of checkoutDef: it sends cmd.<name>, keeps the reservation's and
// the payment's ids from the replies, and is compensated by undo.<name>.
func checkoutStep(name string) *saga.StepDef[Checkout] {
	return saga.Step[Checkout](name).
		Send("cmd."+name, func(c Checkout) (any, error) { return stepCmd{Order: c.Order}, nil }).
		OnReply(func(c *Checkout, r saga.Reply) error {
			var res stepResult
			if err := r.Decode(&res); err != nil {
				return err
			}
			switch name {
			case "reserve":
				c.ReservationID = res.ID
			case "charge":
				c.PaymentID = res.ID
			}
			return nil
		}).
		Compensate("undo."+name, func(c Checkout) (any, error) { return stepCmd{Order: c.Order}, nil }).
		Attempts(3, 10*time.Millisecond)
}

// world is one test's database, orchestrator, participants and bus. Participants record
// every effect in the effect table, so a test counts actions and compensations.
type world struct {
	t       *testing.T
	db      *testdb.DB
	def     *saga.Definition[Checkout]
	orch    *saga.Orchestrator
	bus     *sagatest.Bus
	metrics *saga.Counters
	batched bool // consumers take their messages in batches
	// maxAttempts is the participants' ParticipantConfig.MaxAttempts (0: the default).
	maxAttempts int

	mu        sync.Mutex
	fail      map[string]string        // step -> business failure reason
	failOrder map[string]string        // order -> the step that fails for it ("declined")
	broken    map[string]string        // order -> the step whose handler returns a plain error for it
	transient map[string]int           // step -> transient failures left
	compFail  map[string]int           // step -> failing compensations left
	calls     map[string]int           // "step/phase" -> handler calls
	later     map[string]time.Duration // step -> the wait its action asks for once (inbox.RetryAfter)
	actionAt  map[string][]time.Time   // step -> when its action ran
}

// newWorld builds the world; the action handlers of the steps in down are not subscribed
// (their commands stay in the outbox) until subscribeAction is called, and nothing of a step
// named in down as "!name" is (the test wires its participant).
func newWorld(t *testing.T, def *saga.Definition[Checkout], down ...string) *world {
	t.Helper()
	return newWorldMode(t, false, def, down...)
}

// forModes runs test as parallel subtests, with per-message and with batched consumers.
func forModes(t *testing.T, test func(t *testing.T, batched bool)) {
	for _, batched := range []bool{false, true} {
		name := "per-message"
		if batched {
			name = "batched"
		}
		t.Run(name, func(t *testing.T) { t.Parallel(); test(t, batched) })
	}
}

// newWorldMode is newWorld with the orchestrator and participants consuming in batches
// (saga.ActionProcessor, saga.CompensationProcessor, Orchestrator.ProcessBatch) when batched.
func newWorldMode(t *testing.T, batched bool, def *saga.Definition[Checkout], down ...string) *world {
	t.Helper()
	return newWorldOn(t, testdb.New(t), batched, def, down...)
}

// newWorldOn is newWorldMode on a given test database (testdb.NewServer's, for a test that
// restarts its server).
func newWorldOn(t *testing.T, db *testdb.DB, batched bool, def *saga.Definition[Checkout], down ...string) *world {
	t.Helper()
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE `+db.Schema+`.effect (seq bigserial PRIMARY KEY, saga text NOT NULL, step text NOT NULL, phase text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	w := &world{t: t, db: db, def: def, metrics: &saga.Counters{}, fail: map[string]string{}, transient: map[string]int{},
		compFail: map[string]int{}, calls: map[string]int{}, failOrder: map[string]string{}, broken: map[string]string{},
		later: map[string]time.Duration{}, actionAt: map[string][]time.Time{}}
	w.orch = w.newOrchestrator()
	w.bus = sagatest.NewBus(db.Pool, db.Schema)
	w.batched = batched
	w.orchestrate(w.orch)
	for _, name := range stepNames {
		if slices.Contains(down, "!"+name) {
			continue // the test wires this step's participant itself
		}
		w.subscribeParticipant(name, !slices.Contains(down, name))
	}
	return w
}

// orchestrate subscribes o to the replies, in batches in a batched world.
func (w *world) orchestrate(o *saga.Orchestrator) {
	if w.batched {
		w.bus.OrchestrateBatched(o)
	} else {
		w.bus.Orchestrate(o)
	}
}

// subscribeParticipant subscribes an instance of step name's participant: its compensation,
// and its action when action is set.
func (w *world) subscribeParticipant(name string, action bool) {
	p := w.participant(name)
	switch {
	case w.batched:
		if action {
			w.bus.SubscribeBatch("cmd."+name, saga.ActionProcessor(p, w.action(name)))
		}
		w.bus.SubscribeBatch("undo."+name, saga.CompensationProcessor(p, w.compensation(name)))
	default:
		if action {
			w.bus.Subscribe("cmd."+name, saga.Action(p, w.action(name)))
		}
		w.bus.Subscribe("undo."+name, saga.Compensation(p, w.compensation(name)))
	}
}

func (w *world) participant(name string) *saga.Participant {
	p, err := saga.NewParticipant(saga.ParticipantConfig{Pool: w.db.Pool, Schema: w.db.Schema, Consumer: "svc-" + name, Metrics: w.metrics,
		MaxAttempts: w.maxAttempts})
	if err != nil {
		w.t.Fatal(err)
	}
	return p
}

// subscribeAction starts the action handler of step name (see newWorld's down).
func (w *world) subscribeAction(name string, wrap func(message.NoPublishHandlerFunc) message.NoPublishHandlerFunc) {
	h := saga.Action(w.participant(name), w.action(name))
	if wrap != nil {
		h = wrap(h)
	}
	w.bus.Subscribe("cmd."+name, h)
}

func (w *world) newOrchestrator() *saga.Orchestrator {
	w.t.Helper()
	o, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: w.db.Pool, Schema: w.db.Schema, Metrics: w.metrics, TimerInterval: 20 * time.Millisecond,
		MaxAttempts: w.maxAttempts})
	if err != nil {
		w.t.Fatal(err)
	}
	if err := saga.Register(o, w.def); err != nil {
		w.t.Fatal(err)
	}
	return o
}

func (w *world) action(name string) func(context.Context, pgx.Tx, stepCmd) (stepResult, error) {
	return func(ctx context.Context, tx pgx.Tx, cmd stepCmd) (stepResult, error) {
		w.mu.Lock()
		w.calls[name+"/action"]++
		reason, failing := w.fail[name]
		if w.failOrder[cmd.Order] == name {
			reason, failing = "declined", true
		}
		transient := w.transient[name] > 0
		if transient {
			w.transient[name]--
		}
		broken := w.broken[cmd.Order] == name
		later := w.later[name]
		delete(w.later, name)
		w.actionAt[name] = append(w.actionAt[name], time.Now())
		w.mu.Unlock()
		if broken {
			return stepResult{}, errors.New("relation \"ledger\" is locked: a bug, neither Fail nor Retry")
		}
		// The effect is written before the outcome is known: Fail and Retry must roll it back.
		if _, err := tx.Exec(ctx, `INSERT INTO `+w.db.Schema+`.effect (saga, step, phase) VALUES ($1, $2, 'action')`, cmd.Order, name); err != nil {
			return stepResult{}, err
		}
		switch {
		case failing:
			return stepResult{}, saga.Fail(reason)
		case transient:
			return stepResult{}, saga.Retry(errors.New("provider timeout"))
		case later > 0:
			return stepResult{}, inbox.RetryAfter(errors.New("provider down"), later)
		}
		return stepResult{ID: name + "-" + cmd.Order}, nil
	}
}

func (w *world) compensation(name string) func(context.Context, pgx.Tx, stepCmd) error {
	return func(ctx context.Context, tx pgx.Tx, cmd stepCmd) error {
		w.mu.Lock()
		w.calls[name+"/compensation"]++
		failing := w.compFail[name] != 0
		if w.compFail[name] > 0 {
			w.compFail[name]--
		}
		w.mu.Unlock()
		if _, err := tx.Exec(ctx, `INSERT INTO `+w.db.Schema+`.effect (saga, step, phase) VALUES ($1, $2, 'compensation')`, cmd.Order, name); err != nil {
			return err
		}
		if failing {
			return saga.Retry(errors.New("refund service down"))
		}
		return nil
	}
}

// start starts a checkout saga for order in its own committed transaction.
func (w *world) start(order string, opts ...saga.StartOption) string {
	w.t.Helper()
	var id string
	err := pgx.BeginFunc(context.Background(), w.db.Pool, func(tx pgx.Tx) error {
		var err error
		opts = append([]saga.StartOption{saga.WithID(order), saga.WithWriter(w.writer()), saga.WithMetrics(w.metrics)}, opts...)
		id, err = saga.StartTx(context.Background(), tx, w.def, Checkout{Order: order, Amount: 42}, opts...)
		return err
	})
	if err != nil {
		w.t.Fatal(err)
	}
	return id
}

func (w *world) writer() *outbox.Writer {
	wr, err := outbox.NewWriter(outbox.Config{Schema: w.db.Schema})
	if err != nil {
		w.t.Fatal(err)
	}
	return wr
}

func (w *world) admin() *saga.Admin {
	a, err := saga.NewAdmin(w.db.Schema)
	if err != nil {
		w.t.Fatal(err)
	}
	return a
}

func (w *world) get(id string) *saga.Detail {
	w.t.Helper()
	d, err := w.admin().Get(context.Background(), w.db.Pool, id)
	if err != nil {
		w.t.Fatal(err)
	}
	return d
}

// runUntil delivers messages until the saga is in one of states.
func (w *world) runUntil(id string, states ...saga.State) *saga.Detail {
	w.t.Helper()
	var last *saga.Detail
	err := w.bus.RunUntil(context.Background(), func() bool {
		last = w.get(id)
		for _, s := range states {
			if last.State == s {
				return true
			}
		}
		return false
	})
	if err != nil {
		w.t.Fatalf("saga %s: %v (last state %s, error %q, steps %+v)", id, err, last.State, last.Error, last.Steps)
	}
	return last
}

// effects returns the effects that committed for saga, as "step/phase" in commit order.
func (w *world) effects(sagaID string) []string {
	w.t.Helper()
	rows, err := w.db.Pool.Query(context.Background(), `SELECT step || '/' || phase FROM `+w.db.Schema+`.effect WHERE saga = $1 ORDER BY seq`, sagaID)
	if err != nil {
		w.t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		w.t.Fatal(err)
	}
	return out
}

func (w *world) count(sql string, args ...any) int {
	w.t.Helper()
	var n int
	if err := w.db.Pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		w.t.Fatalf("%s: %v", sql, err)
	}
	return n
}

func statuses(d *saga.Detail) string {
	s := ""
	for i, st := range d.Steps {
		if i > 0 {
			s += " "
		}
		s += fmt.Sprintf("%s:%s", st.Name, st.Status)
	}
	return s
}
