package saga

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

type oldOrder struct {
	Order string `json:"order"`
	Cents int    `json:"cents"`
}

type newOrder struct {
	Order string `json:"order"`
	Total money  `json:"total"`
}

type money struct {
	Cents    int    `json:"cents"`
	Currency string `json:"currency"`
}

func convertOrder(o oldOrder) (newOrder, error) {
	if o.Cents < 0 {
		return newOrder{}, fmt.Errorf("negative amount %d", o.Cents)
	}
	return newOrder{Order: o.Order, Total: money{Cents: o.Cents, Currency: "EUR"}}, nil
}

// upgradeDef is version 2 of a saga whose version 1 had the steps reserve, charge, ship:
// reserve is renamed reserve-stock, and the steps after it are as given.
func upgradeDef(t *testing.T, steps []string, m StepMap, opts ...Option) *Definition[newOrder] {
	t.Helper()
	cmd := func(newOrder) (any, error) { return struct{}{}, nil }
	var defs []*StepDef[newOrder]
	for _, s := range steps {
		defs = append(defs, Step[newOrder](s).Send("v2."+s, cmd).Attempts(5, 10*time.Millisecond))
	}
	if m == nil {
		m = StepMap{"reserve": "reserve-stock"}
	}
	d, err := Define("checkout", 2, defs, append(opts, Upgrade(1, convertOrder, m))...)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// sagaAt is a running version-1 saga at step cur of steps (the ones before it done, the ones
// after it pending), waiting as waiting says; each step that ran sent one command.
func sagaAt(steps []string, cur int, waiting string) *instance {
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	in := &instance{ID: "s-1", Name: "checkout", Version: 1, State: StateRunning, Step: cur, Attempt: 1, Waiting: waiting,
		Data: json.RawMessage(`{"order":"o-1","cents":4200}`), CreatedAt: at, UpdatedAt: at.Add(time.Minute)}
	for i, s := range steps {
		h := StepHistory{Name: s, Status: stepPending}
		switch {
		case i < cur:
			h.Status, h.Attempts = stepDone, 1
			h.Sent = []SentCommand{{Phase: "action", Attempt: 1, Topic: "v1." + s, At: at}}
		case i == cur && waiting != waitRun:
			h.Status, h.Attempts = stepRunning, 1
			h.Sent = []SentCommand{{Phase: "action", Attempt: 1, Topic: "v1." + s, At: at}}
		}
		in.Steps = append(in.Steps, h)
	}
	return in
}

// The boundary rule: a running saga waiting to re-send (every attempt answered) or to run a
// local first step is at a boundary; anything else says why not.
func TestUpgradeBoundary(t *testing.T) {
	t.Parallel()
	v1 := []string{"reserve", "charge", "ship"}
	cases := []struct {
		name string
		in   func() *instance
		want string // "" at a boundary, else a part of the reason
	}{
		{"waiting to re-send", func() *instance { return sagaAt(v1, 1, waitResend) }, ""},
		{"waiting to run a local first step", func() *instance { return sagaAt(v1, 0, waitRun) }, ""},
		{"waiting for a reply", func() *instance { return sagaAt(v1, 1, waitReply) }, "waits for the reply to step charge (attempt 1): a command is in flight"},
		{"an attempt timed out unanswered", func() *instance {
			in := sagaAt(v1, 1, waitResend)
			in.Steps[1].Uncertain = true
			return in
		}, "timed out unanswered"},
		{"compensating", func() *instance {
			in := sagaAt(v1, 0, waitReply)
			in.State, in.Steps[0].Status = StateCompensating, stepCompensating
			return in
		}, "it is compensating (step reserve)"},
		{"stuck compensating", func() *instance {
			in := sagaAt(v1, 0, "")
			in.State, in.Steps[0].Status = StateStuck, stepCompensating
			return in
		}, "stuck compensating step reserve"},
		{"stuck moving forward", func() *instance {
			in := sagaAt(v1, 2, "")
			in.State = StateStuck
			return in
		}, "stuck at step ship"},
		{"completed", func() *instance {
			in := sagaAt(v1, 2, "")
			in.State = StateCompleted
			return in
		}, "finished (completed)"},
		{"compensated", func() *instance {
			in := sagaAt(v1, 0, "")
			in.State = StateCompensated
			return in
		}, "finished (compensated)"},
		{"step index outside the history", func() *instance {
			in := sagaAt(v1, 1, waitResend)
			in.Step = 7
			return in
		}, "not in its history"},
		{"no wait recorded", func() *instance { return sagaAt(v1, 1, "") }, `waits for ""`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := upgradeBoundary(c.in())
			if (c.want == "") != (got == "") || !strings.Contains(got, c.want) {
				t.Fatalf("upgradeBoundary = %q, want %q", got, c.want)
			}
		})
	}
}

// planUpgrade maps a saga's history onto the new steps, or refuses with the reason.
func TestPlanUpgrade(t *testing.T) {
	t.Parallel()
	v1 := []string{"reserve", "charge", "ship"}
	v2 := []string{"reserve-stock", "charge", "ship", "notify"}
	now := time.Date(2026, 1, 2, 3, 10, 0, 0, time.UTC)
	cases := []struct {
		name   string
		in     func() *instance
		def    func(t *testing.T) *Definition[newOrder]
		refuse string // a part of the refusal, "" when it upgrades
		check  func(t *testing.T, p *upgradePlan)
	}{
		{"at the renamed step", func() *instance { return sagaAt(v1, 0, waitResend) }, nil, "", func(t *testing.T, p *upgradePlan) {
			if p.in.Step != 0 || p.in.Version != 2 || p.in.Steps[0].Name != "reserve-stock" || p.in.Steps[0].SentAs != "reserve" || p.in.Steps[0].Status != stepRunning {
				t.Errorf("step 0: %+v (saga at %d, v%d)", p.in.Steps[0], p.in.Step, p.in.Version)
			}
			if got := moves(p.rec.Moves); got != "reserve → reserve-stock (running); charge (pending); ship (pending); + notify (new)" {
				t.Errorf("moves: %s", got)
			}
			if want := `{"order":"o-1","total":{"cents":4200,"currency":"EUR"}}`; string(p.in.Data) != want {
				t.Errorf("data %s, want %s", p.in.Data, want)
			}
			// The re-send is due as version 2 schedules it: 10ms after the failed attempt.
			if p.resendDue == nil || !p.resendDue.Equal(p.in.UpdatedAt.Add(10*time.Millisecond)) {
				t.Errorf("re-send due %v, want 10ms after %v", p.resendDue, p.in.UpdatedAt)
			}
			if p.deadline != nil {
				t.Errorf("deadline %v for a version without one", p.deadline)
			}
		}},
		{"past the renamed step", func() *instance { return sagaAt(v1, 1, waitResend) }, nil, "", func(t *testing.T, p *upgradePlan) {
			s := p.in.Steps
			if p.in.Step != 1 || s[0].Status != stepDone || s[0].SentAs != "reserve" || s[1].Status != stepRunning || s[1].SentAs != "" || s[3].Status != stepPending {
				t.Errorf("history %+v at %d", s, p.in.Step)
			}
			if r := s[1].Upgrades; len(r) != 1 || r[0].From != 1 || r[0].To != 2 || r[0].Step != "charge" || r[0].NewStep != "charge" || !r[0].At.Equal(now) {
				t.Errorf("upgrade record %+v", r)
			}
		}},
		{"a local first step waiting to run", func() *instance { return sagaAt(v1, 0, waitRun) }, nil, "", func(t *testing.T, p *upgradePlan) {
			if p.resendDue != nil || p.in.Steps[0].SentAs != "" || p.in.Steps[0].Name != "reserve-stock" {
				t.Errorf("re-send %v, step %+v: nothing was sent, so nothing keeps the old name", p.resendDue, p.in.Steps[0])
			}
		}},
		{"a removed step not reached is dropped", func() *instance { return sagaAt([]string{"reserve", "charge", "audit"}, 1, waitResend) }, nil, "", func(t *testing.T, p *upgradePlan) {
			if got := moves(p.rec.Moves); got != "reserve → reserve-stock (done); charge (running); - audit (dropped, not reached); + ship (new); + notify (new)" {
				t.Errorf("moves: %s", got)
			}
		}},
		{"a removed step that ran and is not mapped", func() *instance { return sagaAt([]string{"reserve", "audit", "charge"}, 2, waitResend) }, nil,
			"its step audit has history (done), but version 2 has no step of that name", nil},
		{"a removed step that ran, mapped", func() *instance { return sagaAt([]string{"reserve", "audit", "charge"}, 2, waitResend) },
			func(t *testing.T) *Definition[newOrder] {
				return upgradeDef(t, []string{"reserve-stock", "audit-log", "charge", "ship"}, StepMap{"reserve": "reserve-stock", "audit": "audit-log"})
			}, "", func(t *testing.T, p *upgradePlan) {
				if p.in.Step != 2 || p.in.Steps[1].SentAs != "audit" || p.in.Steps[1].Status != stepDone {
					t.Errorf("history %+v at %d", p.in.Steps, p.in.Step)
				}
			}},
		{"a new step before the current one", func() *instance { return sagaAt(v1, 1, waitResend) },
			func(t *testing.T) *Definition[newOrder] {
				return upgradeDef(t, []string{"reserve-stock", "fraud-check", "charge", "ship"}, nil)
			}, "step fraud-check of version 2 comes before step charge", nil},
		{"two steps that ran merged into one", func() *instance { return sagaAt([]string{"reserve", "hold", "charge"}, 2, waitResend) },
			func(t *testing.T) *Definition[newOrder] {
				return upgradeDef(t, v2, StepMap{"reserve": "reserve-stock", "hold": "reserve-stock"})
			}, "its steps reserve and hold both map to step reserve-stock", nil},
		{"steps reordered", func() *instance { return sagaAt(v1, 1, waitResend) },
			func(t *testing.T) *Definition[newOrder] {
				return upgradeDef(t, []string{"charge", "reserve-stock", "ship"}, nil)
			}, "orders its steps", nil},
		{"a renamed step's old name given to a new step", func() *instance { return sagaAt(v1, 0, waitResend) },
			func(t *testing.T) *Definition[newOrder] {
				return upgradeDef(t, []string{"reserve-stock", "reserve", "charge", "ship"}, nil)
			}, "its step reserve-stock sent its commands as reserve, the name version 2 gives step reserve", nil},
		{"past the pivot, before it in the new version", func() *instance {
			in := sagaAt(v1, 2, waitResend)
			in.Steps[1].Pivot = true
			return in
		}, nil, "it passed its pivot charge", nil},
		{"data that does not convert", func() *instance {
			in := sagaAt(v1, 0, waitResend)
			in.Data = json.RawMessage(`{"order":"o-1","cents":-1}`)
			return in
		}, nil, "its data does not convert to version 2: negative amount -1", nil},
		{"data that does not decode", func() *instance {
			in := sagaAt(v1, 0, waitResend)
			in.Data = json.RawMessage(`{"order":7}`)
			return in
		}, nil, "decode the data of version 1 as saga.oldOrder", nil},
		{"the new deadline passed", func() *instance { return sagaAt(v1, 0, waitResend) },
			func(t *testing.T) *Definition[newOrder] { return upgradeDef(t, v2, nil, WithDeadline(time.Minute)) },
			"the deadline of version 2 (1m0s after the start) passed", nil},
		{"the new deadline", func() *instance { return sagaAt(v1, 0, waitResend) },
			func(t *testing.T) *Definition[newOrder] { return upgradeDef(t, v2, nil, WithDeadline(time.Hour)) },
			"", func(t *testing.T, p *upgradePlan) {
				if p.deadline == nil || !p.deadline.Equal(p.in.CreatedAt.Add(time.Hour)) {
					t.Errorf("deadline %v, want an hour after the start", p.deadline)
				}
			}},
		{"another version", func() *instance {
			in := sagaAt(v1, 0, waitResend)
			in.Version = 3
			return in
		}, nil, "it runs version 3", nil},
		{"the target version", func() *instance {
			in := sagaAt(v1, 0, waitResend)
			in.Version = 2
			return in
		}, nil, "it runs version 2 already", nil},
		{"another saga", func() *instance {
			in := sagaAt(v1, 0, waitResend)
			in.Name = "refund"
			return in
		}, nil, `it is a "refund" saga`, nil},
		{"not at a boundary", func() *instance { return sagaAt(v1, 1, waitReply) }, nil, "a command is in flight", nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			def := upgradeDef(t, v2, nil)
			if c.def != nil {
				def = c.def(t)
			}
			in := c.in()
			before, _ := json.Marshal(in)
			p, err := planUpgrade(in, def, def.upgradeFrom(1), now)
			if after, _ := json.Marshal(in); string(after) != string(before) {
				t.Errorf("the plan changed the saga it was given:\n%s\n%s", before, after)
			}
			var r *refusal
			switch {
			case c.refuse == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case c.refuse != "" && (!errors.As(err, &r) || !strings.Contains(err.Error(), c.refuse)):
				t.Fatalf("err = %v, want a refusal with %q", err, c.refuse)
			case c.check != nil:
				c.check(t, p)
			}
		})
	}
}

func moves(ms []StepMove) string {
	var s []string
	for _, m := range ms {
		s = append(s, m.String())
	}
	return strings.Join(s, "; ")
}

// A reply carrying a renamed step's old name finds the step; its new name finds nothing.
func TestStepNamedByItsWireName(t *testing.T) {
	t.Parallel()
	def := upgradeDef(t, []string{"reserve-stock", "charge", "ship", "notify"}, nil)
	p, err := planUpgrade(sagaAt([]string{"reserve", "charge", "ship"}, 1, waitResend), def, def.upgradeFrom(1), time.Now())
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]int{"reserve": 0, "reserve-stock": -1, "charge": 1, "notify": 3, "nope": -1} {
		if got := p.in.stepNamed(def, name); got != want {
			t.Errorf("stepNamed(%q) = %d, want %d", name, got, want)
		}
	}
}

// A step keeps at most maxRefusedRecords refusals, and every upgrade.
func TestRefusalsAreBounded(t *testing.T) {
	t.Parallel()
	in := sagaAt([]string{"reserve"}, 0, waitReply)
	in.Steps[0].Upgrades = []UpgradeRecord{{From: 1, To: 2, Step: "x", NewStep: "reserve"}}
	for i := range 25 {
		in.recordRefusal(UpgradeRecord{From: 1, To: 3, Refused: fmt.Sprint(i)})
	}
	ups := in.Steps[0].Upgrades
	if len(ups) != maxRefusedRecords+1 || ups[0].NewStep != "reserve" || ups[1].Refused != "15" || ups[len(ups)-1].Refused != "24" {
		t.Fatalf("records: %+v", ups)
	}
}
