package saga_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
	"github.com/onceflow/onceflow/saga/sagatest"
)

// CartV1 is version 1's saga data: the amount in cents.
type CartV1 struct {
	Order string `json:"order"`
	Cents int    `json:"cents"`
}

// CartV2 is version 2's: the amount with its currency, and whether the customer was told.
type CartV2 struct {
	Order    string `json:"order"`
	Total    Price  `json:"total"`
	Notified bool   `json:"notified,omitempty"`
}

// Price is an amount in a currency.
type Price struct {
	Cents    int    `json:"cents"`
	Currency string `json:"currency"`
}

type cartCmd struct {
	Order    string `json:"order"`
	Currency string `json:"currency,omitempty"`
}

func cartV1Cmd(c CartV1) (any, error) { return cartCmd{Order: c.Order}, nil }
func cartV2Cmd(c CartV2) (any, error) {
	return cartCmd{Order: c.Order, Currency: c.Total.Currency}, nil
}

func upgradeCart(c CartV1) (CartV2, error) {
	if c.Cents < 0 {
		return CartV2{}, fmt.Errorf("a negative amount (%d cents) cannot be priced", c.Cents)
	}
	return CartV2{Order: c.Order, Total: Price{Cents: c.Cents, Currency: "EUR"}}, nil
}

// cartV1 is reserve → charge → ship; a failed attempt is re-sent five minutes later (the
// backoff is capped at saga.MaxBackoff), so a saga whose participant asked for a retry waits
// at that step boundary for the whole test.
var cartV1 = saga.MustDefine("cart", 1, []*saga.StepDef[CartV1]{
	saga.Step[CartV1]("reserve").Send("v1.reserve", cartV1Cmd).Compensate("v1.release", cartV1Cmd).Attempts(5, time.Hour),
	saga.Step[CartV1]("charge").Send("v1.charge", cartV1Cmd).Compensate("v1.refund", cartV1Cmd).Attempts(5, time.Hour),
	saga.Step[CartV1]("ship").Send("v1.ship", cartV1Cmd).Attempts(5, time.Hour),
})

// cartV2 renames reserve to reserve-stock, sends every command to new topics, adds a notify
// step and prices the cart in a currency; it takes over version 1's running sagas.
var cartV2 = saga.MustDefine("cart", 2, []*saga.StepDef[CartV2]{
	saga.Step[CartV2]("reserve-stock").Send("v2.reserve", cartV2Cmd).Compensate("v2.release", cartV2Cmd).Attempts(3, 10*time.Millisecond),
	saga.Step[CartV2]("charge").Send("v2.charge", cartV2Cmd).Compensate("v2.refund", cartV2Cmd).Attempts(3, 10*time.Millisecond),
	saga.Step[CartV2]("ship").Send("v2.ship", cartV2Cmd).Attempts(3, 10*time.Millisecond),
	saga.Step[CartV2]("notify").Send("v2.notify", cartV2Cmd).
		OnReply(func(c *CartV2, _ saga.Reply) error { c.Notified = true; return nil }),
}, saga.Upgrade(1, upgradeCart, saga.StepMap{"reserve": "reserve-stock"}))

// What a saga of cartWorld is made to do, by its number i: 100 sagas of version 1 at
// different places.
const (
	atReserve   = iota // its reserve asked for a retry: waits to re-send reserve (a boundary)
	atCharge           // its charge asked for a retry: waits to re-send charge (a boundary)
	atShip             // its ship command is in flight (no version-1 shipping runs): waits for the reply
	compensates        // its charge failed: compensating reserve, whose release is in flight
	badData            // i%10 == 4: like atReserve, with data version 2 cannot convert
	shipFails          // i%10 == 9: like atCharge; on version 2 its ship fails, so it compensates
)

func cartClass(i int) int {
	switch i % 10 {
	case 4:
		return badData
	case 9:
		return shipFails
	}
	return i % 5
}

func cartOrder(i int) string { return fmt.Sprintf("o-%03d", i) }

func classOf(order string) int {
	var i int
	if _, err := fmt.Sscanf(order, "o-%d", &i); err != nil {
		panic(err)
	}
	return cartClass(i)
}

// cartWorld runs the two versions' participants (the same services, consumers and barrier rows
// for both versions) and one orchestrator with both versions registered.
type cartWorld struct {
	t    *testing.T
	db   *testdb.DB
	bus  *sagatest.Bus
	orch *saga.Orchestrator
	ps   map[string]*saga.Participant
}

func newCartWorld(t *testing.T, defs ...interface{ Name() string }) *cartWorld {
	t.Helper()
	db := testdb.New(t)
	if _, err := db.Pool.Exec(context.Background(), `CREATE TABLE `+db.Schema+`.effect (seq bigserial PRIMARY KEY, saga text NOT NULL, what text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	w := &cartWorld{t: t, db: db, bus: sagatest.NewBus(db.Pool, db.Schema), ps: map[string]*saga.Participant{}}
	o, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: db.Pool, Schema: db.Schema, TimerInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range defs {
		switch d := d.(type) {
		case *saga.Definition[CartV1]:
			err = saga.Register(o, d)
		case *saga.Definition[CartV2]:
			err = saga.Register(o, d)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	w.orch = o
	w.bus.Orchestrate(o)
	return w
}

func (w *cartWorld) participant(consumer string) *saga.Participant {
	if p, ok := w.ps[consumer]; ok {
		return p
	}
	p, err := saga.NewParticipant(saga.ParticipantConfig{Pool: w.db.Pool, Schema: w.db.Schema, Consumer: consumer})
	if err != nil {
		w.t.Fatal(err)
	}
	w.ps[consumer] = p
	return p
}

// action subscribes a participant's action to topic: decide says what it does for an order
// (nil: it takes effect, recorded as "topic currency").
func (w *cartWorld) action(consumer, topic string, decide func(order string) error) {
	w.bus.Subscribe(topic, saga.Action(w.participant(consumer), func(ctx context.Context, tx pgx.Tx, c cartCmd) (struct{}, error) {
		if decide != nil {
			if err := decide(c.Order); err != nil {
				return struct{}{}, err
			}
		}
		_, err := tx.Exec(ctx, `INSERT INTO `+w.db.Schema+`.effect (saga, what) VALUES ($1, $2)`, c.Order, strings.TrimSpace(topic+" "+c.Currency))
		return struct{}{}, err
	}))
}

func (w *cartWorld) compensation(consumer, topic string) {
	w.bus.Subscribe(topic, saga.Compensation(w.participant(consumer), func(ctx context.Context, tx pgx.Tx, c cartCmd) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+w.db.Schema+`.effect (saga, what) VALUES ($1, $2)`, c.Order, strings.TrimSpace(topic+" "+c.Currency))
		return err
	}))
}

func (w *cartWorld) effects(order string) []string {
	w.t.Helper()
	rows, err := w.db.Pool.Query(context.Background(), `SELECT what FROM `+w.db.Schema+`.effect WHERE saga = $1 ORDER BY seq`, order)
	if err != nil {
		w.t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		w.t.Fatal(err)
	}
	return out
}

func (w *cartWorld) count(sql string) int {
	w.t.Helper()
	var n int
	if err := w.db.Pool.QueryRow(context.Background(), sql).Scan(&n); err != nil {
		w.t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// snapshot is every saga row, timer and outbox row of the schema, as text.
func (w *cartWorld) snapshot() string {
	w.t.Helper()
	var s string
	err := w.db.Pool.QueryRow(context.Background(), `SELECT
		(SELECT coalesce(jsonb_agg(to_jsonb(s) ORDER BY id), '[]') FROM `+w.db.Schema+`.saga s)::text ||
		(SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY saga_id, kind), '[]') FROM `+w.db.Schema+`.saga_timer t)::text ||
		(SELECT coalesce(jsonb_agg(to_jsonb(o) ORDER BY id), '[]') FROM `+w.db.Schema+`.outbox o)::text`).Scan(&s)
	if err != nil {
		w.t.Fatal(err)
	}
	return s
}

// sagaRow is one saga's row as text, with its step history apart.
func (w *cartWorld) sagaRow(id string) (row string, steps []saga.StepHistory) {
	w.t.Helper()
	var raw []byte
	err := w.db.Pool.QueryRow(context.Background(), `SELECT (to_jsonb(s) - 'steps')::text, steps FROM `+w.db.Schema+`.saga s WHERE id = $1`, id).Scan(&row, &raw)
	if err != nil {
		w.t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &steps); err != nil {
		w.t.Fatal(err)
	}
	return row, steps
}

// startCarts starts 100 sagas of version 1 and delivers until each waits where its class
// says (see atReserve ...).
func (w *cartWorld) startCarts(n int) {
	t := w.t
	ctx := context.Background()
	wr, err := outbox.NewWriter(outbox.Config{Schema: w.db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	retry := saga.Retry(errors.New("warehouse busy"))
	w.action("inventory", "v1.reserve", func(o string) error {
		if c := classOf(o); c == atReserve || c == badData {
			return retry
		}
		return nil
	})
	w.action("payments", "v1.charge", func(o string) error {
		switch classOf(o) {
		case atCharge, shipFails:
			return retry
		case compensates:
			return saga.Fail("card declined")
		}
		return nil
	})
	// No version-1 shipping and no version-1 release runs: those commands stay in flight.
	for i := range n {
		cents := 100 + i
		if cartClass(i) == badData {
			cents = -1
		}
		if err := pgx.BeginFunc(ctx, w.db.Pool, func(tx pgx.Tx) error {
			_, err := saga.StartTx(ctx, tx, cartV1, CartV1{Order: cartOrder(i), Cents: cents}, saga.WithID(cartOrder(i)), saga.WithWriter(wr))
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	where := w.db.Schema + `.saga s`
	settled := `SELECT count(*) FROM ` + where + ` WHERE (state = 'running' AND waiting = 'resend') OR (state = 'running' AND step = 2)
		OR (state = 'compensating' AND waiting = 'reply')`
	if err := w.bus.RunUntil(ctx, func() bool { return w.count(settled) == n }); err != nil {
		t.Fatalf("%v: %d of %d sagas where they should be", err, w.count(settled), n)
	}
}

// subscribeV2 starts version 2's participants: ship fails for the shipFails class.
func (w *cartWorld) subscribeV2() {
	w.action("inventory", "v2.reserve", nil)
	w.compensation("inventory", "v2.release")
	w.action("payments", "v2.charge", nil)
	w.compensation("payments", "v2.refund")
	w.action("shipping", "v2.ship", func(o string) error {
		if classOf(o) == shipFails {
			return saga.Fail("no such address")
		}
		return nil
	})
	w.action("notifications", "v2.notify", nil)
}

// The test: 100 running sagas of version 1 — waiting to re-send at reserve or charge
// (boundaries), waiting for the reply of ship (in flight), compensating, or with data version
// 2 cannot convert. Those at a boundary are upgraded to version 2 (a renamed step, a new step,
// another data type) and finish on it: their later commands go to version 2's topics with the
// converted data, and a compensation of the renamed step reaches its participant under the
// name its action ran with, so it undoes the action instead of being taken for a null
// compensation. The others are refused with their reasons and left as they were. A dry run
// changes nothing, and the timeline shows each upgrade.
//
// "applied" upgrades with an Admin given the definition (UpgradeMatching), "requested" files
// requests as the CLI does (RequestUpgradeMatching, no definitions) that the orchestrator
// carries out, recording its refusals in the saga.
func TestUpgradeRunningSagas(t *testing.T) {
	t.Parallel()
	const n = 100
	for _, requested := range []bool{false, true} {
		name := "applied"
		if requested {
			name = "requested"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			w := newCartWorld(t, cartV1, cartV2)
			w.startCarts(n)
			admin, err := saga.NewAdmin(w.db.Schema, cartV1, cartV2)
			if err != nil {
				t.Fatal(err)
			}
			cli, err := saga.NewAdmin(w.db.Schema) // the CLI's: no definitions
			if err != nil {
				t.Fatal(err)
			}
			upgrade := func(o saga.BulkOptions) (saga.UpgradeResult, []saga.SagaUpgrade) {
				t.Helper()
				if requested {
					res, err := cli.RequestUpgradeMatching(ctx, w.db.Pool, "cart", 1, 0, o)
					if err != nil {
						t.Fatal(err)
					}
					return res, res.Requested
				}
				res, err := admin.UpgradeMatching(ctx, w.db.Pool, cartV2, 1, o)
				if err != nil {
					t.Fatal(err)
				}
				return res, res.Upgraded
			}
			// At a boundary by the rows: at reserve or charge, waiting to re-send. An Admin with
			// the definition also converts the data (and refuses badData); the CLI cannot.
			wantDone := func(i int) bool {
				c := cartClass(i)
				return c == atReserve || c == atCharge || c == shipFails || (requested && c == badData)
			}
			wantReason := map[int]string{
				atShip:      "it waits for the reply to step ship (attempt 1): a command is in flight",
				compensates: "it is compensating (step reserve)",
				badData:     "its data does not convert to version 2: a negative amount (-1 cents) cannot be priced",
			}
			check := func(res saga.UpgradeResult, done []saga.SagaUpgrade, what string) {
				t.Helper()
				if len(res.Matched) != n || res.More || len(done)+len(res.Refused) != n {
					t.Fatalf("%s: %d matched (more %v), %d done, %d refused", what, len(res.Matched), res.More, len(done), len(res.Refused))
				}
				for _, u := range done {
					var i int
					fmt.Sscanf(u.ID, "o-%d", &i)
					wantStep := map[int]string{atReserve: "reserve", atCharge: "charge", shipFails: "charge", badData: "reserve"}[cartClass(i)]
					if !wantDone(i) || u.From != 1 || u.Step != wantStep {
						t.Errorf("%s: %s (class %d) done: %+v", what, u.ID, cartClass(i), u)
					}
					if !requested && (u.To != 2 || u.NewStep != map[string]string{"reserve": "reserve-stock", "charge": "charge"}[wantStep] ||
						!strings.Contains(string(u.Data), `"currency":"EUR"`) || u.Moves[len(u.Moves)-1].String() != "+ notify (new)") {
						t.Errorf("%s: %s: mapping %+v, data %s", what, u.ID, u.UpgradeRecord, u.Data)
					}
				}
				for _, r := range res.Refused {
					var i int
					fmt.Sscanf(r.ID, "o-%d", &i)
					if wantDone(i) || !errors.Is(r.Err, saga.ErrNotUpgradable) || !strings.Contains(r.Err.Error(), wantReason[cartClass(i)]) {
						t.Errorf("%s: %s (class %d) refused: %v", what, r.ID, cartClass(i), r.Err)
					}
				}
			}

			before := w.snapshot()
			res, done := upgrade(saga.BulkOptions{DryRun: true, Limit: 1000})
			check(res, done, "dry run")
			if after := w.snapshot(); after != before {
				t.Fatalf("the dry run changed the rows:\nbefore %s\nafter  %s", before, after)
			}
			if res, _ := upgrade(saga.BulkOptions{DryRun: true, Limit: 30}); len(res.Matched) != 30 || !res.More || res.Matched[0] != "o-000" {
				t.Errorf("dry run with a limit: %d matched, more %v, first %v", len(res.Matched), res.More, res.Matched[:1])
			}

			rows := map[string]string{}
			for i := range n {
				rows[cartOrder(i)], _ = w.sagaRow(cartOrder(i))
			}
			res, done = upgrade(saga.BulkOptions{Limit: 1000})
			check(res, done, "upgrade")
			if requested {
				// The orchestrator carries the requests out; it refuses badData's, and says so
				// in the saga.
				if err := w.bus.RunUntil(ctx, func() bool {
					return w.count(`SELECT count(*) FROM `+w.db.Schema+`.saga_timer WHERE kind = 'operator'`) == 0
				}); err != nil {
					t.Fatal(err)
				}
			}
			for i := range n {
				id := cartOrder(i)
				row, steps := w.sagaRow(id)
				switch c := cartClass(i); {
				case c == badData && requested:
					ups := (&saga.Detail{Steps: steps}).Upgrades()
					if len(ups) != 1 || !strings.Contains(ups[0].Refused, wantReason[badData]) || ups[0].From != 1 || ups[0].To != 2 {
						t.Errorf("%s: refusal not recorded: %+v", id, ups)
					}
					if row != rows[id] {
						t.Errorf("%s: a refused upgrade changed the saga:\n%s\n%s", id, rows[id], row)
					}
				case c == atShip || c == compensates || c == badData:
					if row != rows[id] || slices.ContainsFunc(steps, func(s saga.StepHistory) bool { return len(s.Upgrades) > 0 }) {
						t.Errorf("%s: a refused saga changed:\n%s\n%s", id, rows[id], row)
					}
				}
			}

			// Version 2's participants run; the upgraded sagas finish on it.
			w.subscribeV2()
			finished := `SELECT count(*) FROM ` + w.db.Schema + `.saga WHERE version = 2 AND state IN ('completed', 'compensated')`
			if err := w.bus.RunUntil(ctx, func() bool { return w.count(finished) == 50 }); err != nil {
				t.Fatalf("%v: %d of 50 upgraded sagas finished", err, w.count(finished))
			}
			for i := range n {
				id := cartOrder(i)
				c := cartClass(i)
				if c != atReserve && c != atCharge && c != shipFails {
					continue
				}
				d, err := admin.Get(ctx, w.db.Pool, id)
				if err != nil {
					t.Fatal(err)
				}
				var data CartV2
				if err := json.Unmarshal(d.Data, &data); err != nil {
					t.Fatal(err)
				}
				want := map[int][]string{
					atReserve: {"v2.reserve EUR", "v2.charge EUR", "v2.ship EUR", "v2.notify EUR"},
					atCharge:  {"v1.reserve", "v2.charge EUR", "v2.ship EUR", "v2.notify EUR"},
					// reserve's release runs its handler: the barrier finds reserve's action under
					// the name it ran with.
					shipFails: {"v1.reserve", "v2.charge EUR", "v2.refund EUR", "v2.release EUR"},
				}[c]
				wantState, wantData := saga.StateCompleted, CartV2{Order: id, Total: Price{Cents: 100 + i, Currency: "EUR"}, Notified: true}
				if c == shipFails {
					wantState, wantData.Notified = saga.StateCompensated, false
				}
				if got := w.effects(id); d.Version != 2 || d.State != wantState || data != wantData || !slices.Equal(got, want) {
					t.Errorf("%s: v%d %s, data %+v, effects %v; want %s, %+v, %v", id, d.Version, d.State, data, got, wantState, wantData, want)
				}
				ups := d.Upgrades()
				if len(ups) != 1 || ups[0].From != 1 || ups[0].To != 2 || ups[0].Refused != "" || ups[0].At.IsZero() {
					t.Fatalf("%s: timeline %+v", id, ups)
				}
				// Every command sent after the upgrade went to a version-2 topic.
				for _, s := range d.Steps {
					for _, cmd := range s.Sent {
						if cmd.At.After(ups[0].At) != strings.HasPrefix(cmd.Topic, "v2.") {
							t.Errorf("%s: step %s sent to %s at %s (upgraded at %s)", id, s.Name, cmd.Topic, cmd.At, ups[0].At)
						}
					}
				}
				// reserve had sent commands in every class: they keep the name the participant knows.
				if d.Steps[0].Name != "reserve-stock" || d.Steps[0].SentAs != "reserve" {
					t.Errorf("%s: first step %+v", id, d.Steps[0])
				}
			}
		})
	}
}

// Define checks an Upgrade declaration with the rest of the definition and lists every
// problem.
func TestUpgradeDeclarationIsChecked(t *testing.T) {
	t.Parallel()
	steps := []*saga.StepDef[CartV2]{
		saga.Step[CartV2]("reserve-stock").Send("t", cartV2Cmd),
		saga.Step[CartV2]("charge").Send("t", cartV2Cmd),
	}
	_, err := saga.Define("cart", 2, steps,
		saga.Upgrade(1, upgradeCart, saga.StepMap{"reserve": "reserve-stok", "ship": "shipping", "": "charge"}),
		saga.Upgrade(1, upgradeCart, nil),
		saga.Upgrade(2, upgradeCart, nil),
		saga.Upgrade(3, func(c CartV1) (CartV1, error) { return c, nil }, nil),
		saga.Upgrade[CartV1, CartV2](0, nil, nil))
	var ce *saga.ConfigError
	if !errors.As(err, &ce) {
		t.Fatalf("err = %v, want a *ConfigError", err)
	}
	for _, want := range []string{
		`Upgrade from version 1: step "reserve" maps to "reserve-stok", which is not a step of version 2 (its steps: reserve-stock, charge)`,
		`step "ship" maps to "shipping"`,
		"the StepMap maps an empty step name",
		"Upgrade from version 1: declared twice",
		"Upgrade from version 2: only an earlier version (1 to 1) can be upgraded to version 2",
		"Upgrade from version 3: the conversion returns saga_test.CartV1, but the saga data of this definition is saga_test.CartV2",
		"Upgrade from version 0: the conversion function is nil",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
	if len(ce.Problems) != 9 {
		t.Errorf("%d problems, want 9: %v", len(ce.Problems), ce.Problems)
	}
	if _, err := saga.Define("cart", 2, steps, saga.Upgrade(1, upgradeCart, saga.StepMap{"reserve": "reserve-stock"})); err != nil {
		t.Fatal(err)
	}
}

// An upgrade request waits for an orchestrator that has the definition: one without it
// leaves the request (due again a minute later) and the saga as they are; one with it carries
// it out. A request is refused up front when the saga is not at a boundary, runs another
// version, or has a compensation request pending; an Admin refuses a definition that declares
// no upgrade from the version.
func TestUpgradeRequestWaitsForAnOrchestratorWithTheDefinition(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	old := newCartWorld(t, cartV1) // an orchestrator of the previous deploy
	old.startCarts(4)              // o-000 at reserve, o-001 at charge, o-002 at ship, o-003 compensating
	cli, err := saga.NewAdmin(old.db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	request := func(id string, from, to int) error {
		return pgx.BeginFunc(ctx, old.db.Pool, func(tx pgx.Tx) error { return cli.RequestUpgradeTx(ctx, tx, id, from, to) })
	}
	if err := request("o-000", 1, 2); err != nil {
		t.Fatal(err)
	}
	row, _ := old.sagaRow("o-000")
	if _, err := old.orch.FireDue(ctx); err != nil {
		t.Fatal(err)
	}
	left := `SELECT count(*) FROM ` + old.db.Schema + `.saga_timer WHERE saga_id = 'o-000' AND kind = 'operator' AND action = 'upgrade' AND due_at > now() + interval '50 seconds'`
	if after, _ := old.sagaRow("o-000"); old.count(left) != 1 || after != row {
		t.Fatalf("an orchestrator without version 2: request left %d, saga\n%s\n%s", old.count(left), row, after)
	}

	// The new deploy's orchestrator has version 2 (its request is due again: the test does
	// not wait the minute).
	o, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: old.db.Pool, Schema: old.db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := saga.Register(o, cartV2); err != nil {
		t.Fatal(err)
	}
	if _, err := old.db.Pool.Exec(ctx, `UPDATE `+old.db.Schema+`.saga_timer SET due_at = now() WHERE kind = 'operator'`); err != nil {
		t.Fatal(err)
	}
	if _, err := o.FireDue(ctx); err != nil {
		t.Fatal(err)
	}
	d, err := cli.Get(ctx, old.db.Pool, "o-000")
	if err != nil {
		t.Fatal(err)
	}
	if ups := d.Upgrades(); d.Version != 2 || d.Step != "reserve-stock" || len(ups) != 1 || ups[0].NewStep != "reserve-stock" {
		t.Fatalf("after the orchestrator with version 2: v%d at %s, timeline %+v", d.Version, d.Step, ups)
	}

	for _, c := range []struct {
		id       string
		from, to int
		want     error
		text     string
	}{
		{"o-002", 1, 0, saga.ErrNotUpgradable, "a command is in flight"},
		{"o-003", 1, 0, saga.ErrNotUpgradable, "it is compensating"},
		{"o-000", 1, 0, saga.ErrNotUpgradable, "it runs version 2, not 1"},
		{"o-404", 1, 0, saga.ErrNotFound, "o-404"},
		{"o-001", 2, 1, saga.ErrBadFilter, "from version 2 to version 1"},
	} {
		if err := request(c.id, c.from, c.to); !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.text) {
			t.Errorf("request %s: %v, want %v with %q", c.id, err, c.want, c.text)
		}
	}
	if err := pgx.BeginFunc(ctx, old.db.Pool, func(tx pgx.Tx) error { return cli.CompensateTx(ctx, tx, "o-001") }); err != nil {
		t.Fatal(err)
	}
	if err := request("o-001", 1, 2); !errors.Is(err, saga.ErrWrongState) || !strings.Contains(err.Error(), "compensate request pending") {
		t.Errorf("request with a compensation pending: %v", err)
	}
	if _, err := cli.UpgradeMatching(ctx, old.db.Pool, cartV1, 1, saga.BulkOptions{}); err == nil || !strings.Contains(err.Error(), "declares no upgrade from version 1; add saga.Upgrade(1") {
		t.Errorf("UpgradeMatching to a definition without the declaration: %v", err)
	}
}

// A request for "the newest version" (to 0, what `onceflow saga upgrade` files without --to)
// is carried out by an orchestrator of the new deploy that has only the new version.
func TestUpgradeRequestToTheNewestVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newCartWorld(t, cartV1)
	w.startCarts(1) // o-000 at reserve, waiting to re-send
	cli, err := saga.NewAdmin(w.db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, w.db.Pool, func(tx pgx.Tx) error { return cli.RequestUpgradeTx(ctx, tx, "o-000", 1, 0) }); err != nil {
		t.Fatal(err)
	}
	o, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: w.db.Pool, Schema: w.db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := saga.Register(o, cartV2); err != nil {
		t.Fatal(err)
	}
	if _, err := o.FireDue(ctx); err != nil {
		t.Fatal(err)
	}
	d, err := cli.Get(ctx, w.db.Pool, "o-000")
	if err != nil {
		t.Fatal(err)
	}
	if ups := d.Upgrades(); d.Version != 2 || len(ups) != 1 || ups[0].To != 2 || ups[0].Refused != "" {
		t.Fatalf("an orchestrator with only version 2 did not carry out the request for the newest version: v%d, timeline %+v", d.Version, ups)
	}
}
