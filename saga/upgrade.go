package saga

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/onceflow/onceflow/internal/engine"
	"github.com/onceflow/onceflow/internal/failure"
	"github.com/onceflow/onceflow/outbox"
)

// Upgrading running sagas in place (docs/sagas.md, "Upgrading running sagas"): a definition
// declares, with the Upgrade option, how it takes over the running sagas of an earlier version
// — a conversion of their data and a mapping of their steps — and an upgrade rewrites one
// saga, at a step boundary, in one transaction under its row lock: its version, its data, its
// step history re-mapped onto the new steps, its step index and its timers. This file holds
// the declaration and the pure planning; upgrade_apply.go the SQL, the Admin calls and the
// orchestrator's handling of an upgrade request.

// StepMap maps step names of an earlier version onto step names of the version that declares
// the Upgrade: old name → new name. An old step that is not a key maps to the new step of the
// same name, if there is one; one that is neither (a removed step) keeps a saga whose history
// includes it from being upgraded, unless the map says which new step took its place.
type StepMap map[string]string

// upgradeDecl is a definition's declaration that it takes over running sagas of an earlier
// version (Upgrade), type-erased: the data travels as JSON.
type upgradeDecl struct {
	from  int
	steps StepMap
	// target is a (*New)(nil), checked against the definition's data type by Define.
	target any
	// convert decodes the old data, converts it and encodes the result; nil when Upgrade
	// was given a nil function (Define refuses it).
	convert func(old json.RawMessage) (json.RawMessage, error)
}

// Upgrade declares that the definition it is passed to (Define's option) takes over running
// sagas of version from of the same name: convert turns their data, decoded from JSON as the
// saga decodes its data (encoding/json into Old), into this version's data; steps maps the old
// version's step names onto this version's (see StepMap). Define checks the declaration with
// the rest, reporting every problem: an earlier version (1 ≤ from < version), one declaration
// per version, a non-nil convert whose New is the definition's data type, and targets that are
// steps of this version.
//
// The declaration does not upgrade anything by itself. Admin.UpgradeMatching upgrades the
// sagas of version from that are at a step boundary, in a service that has this definition;
// `onceflow saga upgrade` files requests that an orchestrator with this definition registered
// carries out. Only a running saga between two attempts (waiting to re-send the current
// step's command, or to run a local first step) is upgraded: see docs/sagas.md.
//
// convert runs on the orchestrator's (or the Admin's) goroutine within the upgrade's
// transaction: keep it a pure function of the old data. An error (or a panic) refuses the
// upgrade of that saga, which goes on unchanged on its version.
func Upgrade[Old, New any](from int, convert func(Old) (New, error), steps StepMap) Option {
	d := upgradeDecl{from: from, steps: maps.Clone(steps), target: (*New)(nil)}
	if convert != nil {
		d.convert = func(raw json.RawMessage) (json.RawMessage, error) {
			var old Old
			if err := json.Unmarshal(raw, &old); err != nil {
				return nil, fmt.Errorf("decode the data of version %d as %T: %w", from, old, err)
			}
			return engine.Call(func() (json.RawMessage, error) {
				v, err := convert(old)
				if err != nil {
					return nil, err
				}
				return json.Marshal(v)
			})
		}
	}
	return func(o *options) { o.upgrades = append(o.upgrades, d) }
}

// upgradeProblems checks the definition's Upgrade declarations (called by Define).
func (d *Definition[D]) upgradeProblems() []error {
	var problems []error
	var names []string
	for _, s := range d.steps {
		if s != nil {
			names = append(names, s.name)
		}
	}
	seen := map[int]bool{}
	for _, u := range d.opts.upgrades {
		where := fmt.Sprintf("Upgrade from version %d", u.from)
		switch {
		case u.from < 1 || u.from >= d.version:
			problems = append(problems, fmt.Errorf("%s: only an earlier version (1 to %d) can be upgraded to version %d", where, d.version-1, d.version))
		case seen[u.from]:
			problems = append(problems, fmt.Errorf("%s: declared twice; give one Upgrade per earlier version", where))
		}
		seen[u.from] = true
		if u.convert == nil {
			problems = append(problems, fmt.Errorf("%s: the conversion function is nil; pass a func(old) (%T, error)", where, *new(D)))
		}
		if _, ok := u.target.(*D); !ok {
			problems = append(problems, fmt.Errorf("%s: the conversion returns %s, but the saga data of this definition is %T; convert to %T",
				where, strings.TrimPrefix(fmt.Sprintf("%T", u.target), "*"), *new(D), *new(D)))
		}
		for _, old := range slices.Sorted(maps.Keys(u.steps)) {
			to := u.steps[old]
			switch {
			case old == "":
				problems = append(problems, fmt.Errorf("%s: the StepMap maps an empty step name; its keys are step names of version %d", where, u.from))
			case !slices.Contains(names, to):
				problems = append(problems, fmt.Errorf("%s: step %q maps to %q, which is not a step of version %d (its steps: %s)",
					where, old, to, d.version, strings.Join(names, ", ")))
			}
		}
	}
	return problems
}

// upgradeFrom returns the definition's declaration of an upgrade from version from, or nil.
func (d *Definition[D]) upgradeFrom(from int) *upgradeDecl {
	for i := range d.opts.upgrades {
		if d.opts.upgrades[i].from == from {
			return &d.opts.upgrades[i]
		}
	}
	return nil
}

// upgradeTarget is a definition that may declare upgrades: any *Definition[D].
type upgradeTarget interface {
	definition
	upgradeFrom(from int) *upgradeDecl
}

// ErrNotUpgradable is wrapped by the refusal of an upgrade of one saga: it is not running at
// a step boundary (it waits for a reply, compensates, is stuck or finished), it is of another
// definition or version, its history has a step the declaration does not map, or its data
// does not convert. The saga is left as it was; the error says why and what to do.
var ErrNotUpgradable = errors.New("saga: not upgradable")

// refusal is why one saga is not upgraded: a reason for the operator, without the saga's id.
type refusal struct{ reason string }

func (r *refusal) Error() string { return r.reason }

func refuse(format string, args ...any) error { return &refusal{fmt.Sprintf(format, args...)} }

// UpgradeRecord is an upgrade of a saga, or a refused one, in its history (StepHistory's
// Upgrades, Detail.Upgrades): `onceflow saga show` prints them.
type UpgradeRecord struct {
	// From and To are the definition versions: the saga's, and the one it was upgraded to.
	From int `json:"from"`
	To   int `json:"to"`
	// At is when, on the database's clock.
	At time.Time `json:"at"`
	// Step is the step the saga was at (its name in version From); NewStep the step it goes
	// on at in version To ("" when refused).
	Step    string `json:"step"`
	NewStep string `json:"new_step,omitempty"`
	// Moves says where each step of version From went, and which steps of version To are new.
	Moves []StepMove `json:"moves,omitempty"`
	// Refused is why the upgrade was refused; the saga was not changed (but for this record).
	Refused string `json:"refused,omitempty"`
}

// StepMove is where one step of a saga went in an upgrade.
type StepMove struct {
	// From is the step's name in the old version; "" for a step that is new in the new one.
	From string `json:"from,omitempty"`
	// To is its name in the new version; "" for a step of the old version that the saga had
	// not reached and that the new version no longer has (dropped).
	To string `json:"to,omitempty"`
	// Status is the step's status when the saga was upgraded (pending for a new step).
	Status string `json:"status"`
}

// String is "reserve → reserve-stock (done)", "+ notify (new)" or "- audit (dropped)".
func (m StepMove) String() string {
	switch {
	case m.From == "":
		return "+ " + m.To + " (new)"
	case m.To == "":
		return "- " + m.From + " (dropped, not reached)"
	case m.From == m.To:
		return m.From + " (" + m.Status + ")"
	}
	return m.From + " → " + m.To + " (" + m.Status + ")"
}

// Upgrades returns the saga's upgrades and refused upgrades, oldest first.
func (d *Detail) Upgrades() []UpgradeRecord {
	var out []UpgradeRecord
	for _, s := range d.Steps {
		out = append(out, s.Upgrades...)
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].At.Before(out[j].At) })
	return out
}

// maxRefusedRecords bounds the refused upgrades a step keeps: a request filed again and again
// must not grow the saga row without end.
const maxRefusedRecords = 10

// recordRefusal appends a refused upgrade to the history of the saga's current step, keeping
// at most maxRefusedRecords refusals there.
func (in *instance) recordRefusal(r UpgradeRecord) {
	if len(in.Steps) == 0 {
		return
	}
	i := min(max(in.Step, 0), len(in.Steps)-1)
	ups := append(in.Steps[i].Upgrades, r)
	refused := 0
	for _, u := range ups {
		if u.Refused != "" {
			refused++
		}
	}
	for k := 0; refused > maxRefusedRecords && k < len(ups); {
		if ups[k].Refused != "" {
			ups = slices.Delete(ups, k, k+1)
			refused--
			continue
		}
		k++
	}
	in.Steps[i].Upgrades = ups
}

// wireName is the step name the step's commands carry (see SentAs).
func (h *StepHistory) wireName() string {
	if h.SentAs != "" {
		return h.SentAs
	}
	return h.Name
}

// stepNamed returns the index of the saga's step whose commands carry the name step (a
// reply's), or -1. A step an upgrade renamed after it sent commands is found by its old name
// (SentAs); for every other saga this is the definition's step of that name.
func (in *instance) stepNamed(def definition, step string) int {
	for i := range in.Steps {
		if in.Steps[i].SentAs == step {
			return i
		}
	}
	i := def.stepIndex(step)
	if i >= 0 && i < len(in.Steps) && in.Steps[i].SentAs != "" {
		return -1 // that step's commands carry its old name: no reply carries this one
	}
	return i
}

// upgradeBoundary says why a saga is not at a step boundary, where it may be upgraded, or ""
// when it is. It reads the saga row only, so an Admin without the definitions can tell:
//
//   - the saga is running (not compensating, stuck or finished), and
//   - no command of it is in flight: it waits to re-send its current step's command after a
//     failed attempt (waiting = resend; every attempt sent was answered, none timed out
//     unanswered) or to run a local first step (waiting = run; nothing was sent).
//
// A saga waiting for a reply is not at a boundary: the reply would be applied by the new
// version's handler to a command the old version sent. A saga that is compensating or stuck
// finishes on its version.
func upgradeBoundary(in *instance) string {
	cur := fmt.Sprintf("#%d", in.Step)
	var rec *StepHistory
	if in.Step >= 0 && in.Step < len(in.Steps) {
		rec = &in.Steps[in.Step]
		cur = rec.Name
	}
	switch in.State {
	case StateCompleted, StateCompensated:
		return fmt.Sprintf("it has finished (%s); only a running saga can be upgraded", in.State)
	case StateCompensating:
		return fmt.Sprintf("it is compensating (step %s); a saga that compensates finishes on its version", cur)
	case StateStuck:
		if in.stuckPhase() == outbox.SagaPhaseCompensation {
			return fmt.Sprintf("it is stuck compensating step %s; `onceflow saga retry` resumes it, and it finishes on its version", cur)
		}
		return fmt.Sprintf("it is stuck at step %s, whose command may have taken effect; resume it with `onceflow saga retry` and upgrade it once it waits to re-send a command", cur)
	case StateRunning:
	default:
		return fmt.Sprintf("its state %q is not one onceflow knows", in.State)
	}
	if rec == nil {
		return fmt.Sprintf("its current step (index %d) is not in its history of %d steps", in.Step, len(in.Steps))
	}
	switch in.Waiting {
	case waitRun:
		return ""
	case waitResend:
		if rec.Uncertain {
			return fmt.Sprintf("an attempt of step %s timed out unanswered, so its command may still act and reply; upgrade it once the saga is at a later step", cur)
		}
		return ""
	case waitReply:
		what := "reply to"
		if rec.Local {
			what = "run of"
		}
		return fmt.Sprintf("it waits for the %s step %s (attempt %d): a command is in flight; a saga is upgraded between attempts only (waiting to re-send), so try again later", what, cur, in.Attempt)
	}
	return fmt.Sprintf("it waits for %q, which is not a step boundary", in.Waiting)
}

// upgradePlan is one saga's upgrade, computed from its row.
type upgradePlan struct {
	in  *instance // the upgraded saga: a copy, with its new version, data, step and history
	rec UpgradeRecord
	// resendDue is when the re-send fires under the new version (waiting = resend), nil to keep
	// the step timer's due time (waiting = run: due at once).
	resendDue *time.Time
	// deadline is the new version's deadline timer, nil when it has none.
	deadline *time.Time
}

// planUpgrade computes the upgrade of saga in (read under its row lock, or for a dry run)
// to def by the declaration u, at now (the database's clock), or refuses it (*refusal). It
// changes nothing: the plan holds a copy.
func planUpgrade(in *instance, def upgradeTarget, u *upgradeDecl, now time.Time) (*upgradePlan, error) {
	switch {
	case in.Name != def.Name():
		return nil, refuse("it is a %q saga; version %d is of %q", in.Name, def.Version(), def.Name())
	case in.Version == def.Version():
		return nil, refuse("it runs version %d already", in.Version)
	case in.Version != u.from:
		return nil, refuse("it runs version %d, and version %d declares an upgrade from version %d", in.Version, def.Version(), u.from)
	}
	if why := upgradeBoundary(in); why != "" {
		return nil, refuse("%s", why)
	}
	n := def.stepCount()
	src := make([]int, n) // src[j]: the old step whose history step j of the new version takes, or -1
	for j := range src {
		src[j] = -1
	}
	target := func(name string) int {
		if to, ok := u.steps[name]; ok {
			return def.stepIndex(to)
		}
		return def.stepIndex(name)
	}
	newStep, last := -1, -1
	for i, h := range in.Steps {
		if h.Status == stepPending && i != in.Step {
			continue // never reached: no history to carry over
		}
		j := target(h.Name)
		switch {
		case j < 0:
			return nil, refuse("its step %s has history (%s), but version %d has no step of that name and the upgrade's StepMap does not map it; "+
				"map it to the step of version %d that took its place", h.Name, h.Status, def.Version(), def.Version())
		case src[j] >= 0:
			return nil, refuse("its steps %s and %s both map to step %s of version %d, and both ran; a step's history cannot be merged",
				in.Steps[src[j]].Name, h.Name, def.step(j).name, def.Version())
		case j < last:
			return nil, refuse("version %d orders its steps %s and %s the other way round; the upgrade keeps the order of the steps that ran",
				def.Version(), def.step(j).name, def.step(last).name)
		}
		src[j], last = i, j
		if i == in.Step {
			newStep = j
		}
	}
	for j := range newStep {
		if src[j] < 0 {
			return nil, refuse("step %s of version %d comes before step %s, where the saga goes on, and never ran for it; "+
				"an upgrade does not skip a step: let the saga finish on version %d", def.step(j).name, def.Version(), def.step(newStep).name, in.Version)
		}
	}
	oldStep := in.Steps[in.Step].Name
	if p := recordedPivot(in); p >= 0 && in.Step >= p && newStep < def.pivotIndex() {
		return nil, refuse("it passed its pivot %s, so it only goes forward, but version %d puts step %s before its pivot, where the saga could compensate again",
			in.Steps[p].Name, def.Version(), def.step(newStep).name)
	}

	// The history: a step that ran keeps its history under its new name; the others start
	// pending. Local and pivot marks follow the new version.
	steps := make([]StepHistory, n)
	var moves []StepMove
	for i, h := range in.Steps {
		m := StepMove{From: h.Name, Status: h.Status}
		if j := target(h.Name); j >= 0 && (src[j] == i || src[j] < 0) {
			m.To = def.step(j).name
		}
		moves = append(moves, m)
	}
	for j := range n {
		p := def.step(j)
		i := src[j]
		if i < 0 {
			steps[j] = StepHistory{Name: p.name, Status: stepPending}
			if !slices.ContainsFunc(moves, func(m StepMove) bool { return m.To == p.name }) {
				moves = append(moves, StepMove{To: p.name, Status: stepPending})
			}
		} else {
			h := in.Steps[i]
			h.Sent, h.Replies, h.Upgrades = slices.Clone(h.Sent), slices.Clone(h.Replies), slices.Clone(h.Upgrades)
			// The participants know the step by the name its commands carried: its barrier
			// rows and dedup keys. A step that sent commands keeps that name on the wire.
			wire := h.wireName()
			h.Name, h.SentAs = p.name, ""
			if wire != p.name && len(h.Sent) > 0 {
				h.SentAs = wire
			}
			steps[j] = h
		}
		steps[j].Local, steps[j].LocalCompensation, steps[j].Pivot = p.local, p.compLocal, j == def.pivotIndex()
	}
	for j := range steps {
		for k := range j {
			if steps[j].wireName() == steps[k].wireName() {
				a, b := steps[k], steps[j]
				if a.SentAs == "" {
					a, b = b, a
				}
				return nil, refuse("its step %s sent its commands as %s, the name version %d gives step %s: the participants would take one for the other",
					a.Name, a.SentAs, def.Version(), b.Name)
			}
		}
	}

	data, err := u.convert(in.Data)
	if err != nil {
		return nil, refuse("its data does not convert to version %d: %v", def.Version(), err)
	}

	plan := &upgradePlan{rec: UpgradeRecord{From: in.Version, To: def.Version(), At: now, Step: oldStep, NewStep: steps[newStep].Name, Moves: moves}}
	if d := def.deadline(); d > 0 {
		due := in.CreatedAt.Add(d)
		if newStep < def.pivotIndex() && !now.Before(due) {
			return nil, refuse("the deadline of version %d (%s after the start) passed at %s: the upgraded saga would compensate at once",
				def.Version(), d, due.UTC().Format(time.RFC3339))
		}
		plan.deadline = &due
	}
	if in.Waiting == waitResend {
		// The re-send is due when the new version would have scheduled it, from the failed
		// attempt (the saga's last transition) with the new step's backoff.
		due := in.UpdatedAt.Add(failure.Backoff(def.step(newStep).backoff, MaxBackoff, in.Attempt-in.Budget))
		plan.resendDue = &due
	}
	out := *in
	out.Version, out.Data, out.Steps, out.Step = def.Version(), data, steps, newStep
	out.Steps[newStep].Upgrades = append(out.Steps[newStep].Upgrades, plan.rec)
	plan.in = &out
	return plan, nil
}
