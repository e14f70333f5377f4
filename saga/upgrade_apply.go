package saga

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/audit"
	"github.com/onceflow/onceflow/internal/pgsql"
)

// actUpgrade is an operator request to upgrade a saga (Admin.RequestUpgradeTx). Its timer row
// (kind operator) holds the version to upgrade from in step and the version to upgrade to in
// attempt (0: the newest registered version that declares an upgrade from it), so no
// migration was needed for it.
const actUpgrade = "upgrade"

// upgradeSQL is the SQL of upgrades on one schema's saga tables.
type upgradeSQL struct {
	stepTimer, saga, moveTimer, delRequest, refused, request, pending, selectVersion string
}

func (st store) upgradeSQL() upgradeSQL {
	sagaT, timerT := pgsql.Table(st.schema, "saga"), pgsql.Table(st.schema, "saga_timer")
	return upgradeSQL{
		stepTimer: `SELECT due_at FROM ` + timerT + ` WHERE saga_id = $1 AND kind = 'step' AND action = $2 AND step = $3 AND attempt = $4`,
		// version = $6: the row is locked, so this only guards against a caller's mistake.
		saga: `UPDATE ` + sagaT + ` SET version = $2, step = $3, data = $4, steps = $5, updated_at = now()
			WHERE id = $1 AND version = $6`,
		moveTimer:  `UPDATE ` + timerT + ` SET step = $2, due_at = coalesce($3::timestamptz, due_at) WHERE saga_id = $1 AND kind = 'step'`,
		delRequest: `DELETE FROM ` + timerT + ` WHERE saga_id = $1 AND kind = 'operator' AND action = 'upgrade'`,
		// A refused upgrade changes the history only: not updated_at, which the saga's last
		// transition set (a later upgrade computes the re-send from it).
		refused: `UPDATE ` + sagaT + ` SET steps = $2 WHERE id = $1`,
		// Only an upgrade request is replaced: a retry or compensation request goes first.
		request: `INSERT INTO ` + timerT + ` AS t (saga_id, kind, step, attempt, action, due_at) VALUES ($1, 'operator', $2, $3, 'upgrade', now())
			ON CONFLICT (saga_id, kind) DO UPDATE SET step = EXCLUDED.step, attempt = EXCLUDED.attempt, due_at = EXCLUDED.due_at
			WHERE t.action = 'upgrade'`,
		pending: `SELECT action FROM ` + timerT + ` WHERE saga_id = $1 AND kind = 'operator'`,
		// The unfinished sagas of one version, oldest first (saga_state_created_idx): the
		// long-running ones an upgrade is for.
		selectVersion: `SELECT id FROM ` + sagaT + ` WHERE state IN ('running', 'compensating', 'stuck') AND name = $1 AND version = $2
			ORDER BY created_at, id LIMIT $3`,
	}
}

// checkUpgrade plans the upgrade of in (locked in db by the caller, or read for a dry run)
// and checks that the timer ending its wait is there: the upgrade moves it to the new step.
func (st store) checkUpgrade(ctx context.Context, db DB, in *instance, def upgradeTarget, u *upgradeDecl, now time.Time) (*upgradePlan, error) {
	plan, err := planUpgrade(in, def, u, now)
	if err != nil {
		return nil, err
	}
	action, what := actResend, "re-send"
	if in.Waiting == waitRun {
		action, what = actRun, "run"
	}
	var due time.Time
	err = db.QueryRow(ctx, st.upgradeSQL().stepTimer, in.ID, action, in.Step, in.Attempt).Scan(&due)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, refuse("its row says it waits to %s step %s, but no %s timer would do it; `onceflow saga show %s` shows its timers",
			what, in.Steps[in.Step].Name, action, in.ID)
	}
	if err != nil {
		return nil, fmt.Errorf("saga: the step timer of saga %q: %w", in.ID, st.explain(err))
	}
	return plan, nil
}

// writeUpgrade stores a planned upgrade in tx, which holds the saga's row lock, in one round
// trip: the saga row (version, data, step, history), its step timer moved to the new step
// (and re-timed for a re-send), its deadline timer as the new version has it, and no pending
// upgrade request.
func (st store) writeUpgrade(ctx context.Context, tx pgx.Tx, old int, p *upgradePlan) error {
	in := p.in
	steps, err := json.Marshal(in.Steps)
	if err != nil {
		return err
	}
	q := st.upgradeSQL()
	b := &pgx.Batch{}
	b.Queue(q.saga, in.ID, in.Version, in.Step, in.Data, steps, old)
	b.Queue(q.moveTimer, in.ID, in.Step, p.resendDue)
	if p.deadline != nil {
		b.Queue(st.setTimer, in.ID, timerDeadline, 0, "", 0, actDeadline, *p.deadline)
	} else {
		b.Queue(st.delTimer, in.ID, timerDeadline)
	}
	b.Queue(q.delRequest, in.ID)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("saga: store the upgrade of saga %q: %w", in.ID, st.explain(err))
	}
	return nil
}

// SagaUpgrade is one saga's upgrade: where it was, where it goes on, how its steps were
// mapped and its converted data.
type SagaUpgrade struct {
	ID string
	// UpgradeRecord is what the saga's history records. For a request filed by an Admin
	// without the definition (RequestUpgradeMatching), only From, Step and To (0: the newest
	// version that declares it) are known: the orchestrator maps the steps.
	UpgradeRecord
	// Data is the saga's data converted to the new version (nil when not known).
	Data json.RawMessage
}

// UpgradeResult reports an upgrade of many sagas saga by saga. On a dry run it says what would
// be done; nothing is changed.
type UpgradeResult struct {
	// Matched are the ids of the unfinished sagas of the version, oldest first, at most Limit.
	Matched []string
	// More is set when more sagas of the version are unfinished than Limit.
	More bool
	// Upgraded are the sagas upgraded (UpgradeMatching), each in its own transaction.
	Upgraded []SagaUpgrade
	// Requested are the sagas whose upgrade request was filed (RequestUpgradeMatching).
	Requested []SagaUpgrade
	// Refused are the sagas not upgraded (or not requested), each with the reason, wrapping
	// ErrNotUpgradable (or ErrNotFound, ErrWrongState): they are unchanged.
	Refused []BulkRefusal
}

// declaredUpgrade returns def as an upgrade target with its declaration of an upgrade from
// version from.
func declaredUpgrade(def Known, from int) (upgradeTarget, *upgradeDecl, error) {
	t, ok := def.(upgradeTarget)
	if !ok || def == nil {
		return nil, nil, fmt.Errorf("saga: upgrade to %T: pass the *saga.Definition of the new version", def)
	}
	u := t.upgradeFrom(from)
	if u == nil {
		return nil, nil, fmt.Errorf("saga: definition %q version %d declares no upgrade from version %d; add saga.Upgrade(%d, convert, steps) to its Define",
			def.Name(), def.Version(), from, from)
	}
	return t, u, nil
}

func notUpgradable(id string, err error) error {
	var r *refusal
	if errors.As(err, &r) {
		return refused(ErrNotUpgradable, id, "%s", r.reason)
	}
	return err
}

// UpgradeTx upgrades the saga id to def, the new version, by its Upgrade declaration for
// version from, in tx: under the saga's row lock, its version, data (converted), step history
// (re-mapped onto def's steps), step index and timers are rewritten, and the upgrade is
// recorded in the history of the step it goes on at (Detail.Upgrades, `onceflow saga show`).
// It sends no command: the saga goes on when its timer fires, on def. Register def with the
// orchestrators before upgrading to it: they advance the saga from then on.
//
// Only a running saga at a step boundary is upgraded: waiting to re-send its current step's
// command (every attempt sent was answered) or to run a local first step. The re-send is due
// when def would have scheduled it: the failed attempt's time plus the new step's backoff.
// Anything else is refused with an error wrapping ErrNotUpgradable that says why — a command
// in flight, compensating, stuck or finished, another definition or version, a step of its
// history that def's StepMap lacks, a new step before the one it would go on at, data that does
// not convert, def's deadline passed — and the saga is left as it was. An unknown id is
// ErrNotFound; a def that declares no upgrade from from is an error of its own.
func (a *Admin) UpgradeTx(ctx context.Context, tx pgx.Tx, def Known, id string, from int) (SagaUpgrade, error) {
	t, u, err := declaredUpgrade(def, from)
	if err != nil {
		return SagaUpgrade{}, err
	}
	return a.upgradeTx(ctx, tx, t, u, id)
}

func (a *Admin) upgradeTx(ctx context.Context, tx pgx.Tx, def upgradeTarget, u *upgradeDecl, id string) (SagaUpgrade, error) {
	in, now, err := a.st.load(ctx, tx, id, true)
	if errors.Is(err, errNoSaga) {
		return SagaUpgrade{}, fmt.Errorf("%w: %q", ErrNotFound, id)
	}
	if err != nil {
		return SagaUpgrade{}, err
	}
	plan, err := a.st.checkUpgrade(ctx, tx, in, def, u, now)
	if err != nil {
		return SagaUpgrade{}, notUpgradable(id, err)
	}
	if err := a.st.writeUpgrade(ctx, tx, in.Version, plan); err != nil {
		return SagaUpgrade{}, err
	}
	if err := audit.RecordTx(ctx, tx, a.st.schema, audit.SagaUpgrade, []string{id},
		fmt.Sprintf("upgraded from version %d to %d, step %s → %s", plan.rec.From, plan.rec.To, plan.rec.Step, plan.rec.NewStep)); err != nil {
		return SagaUpgrade{}, fmt.Errorf("saga: %w", a.st.explain(err))
	}
	return SagaUpgrade{ID: id, UpgradeRecord: plan.rec, Data: plan.in.Data}, nil
}

// dryUpgrade plans the upgrade of saga id without a lock and changes nothing.
func (a *Admin) dryUpgrade(ctx context.Context, db DB, def upgradeTarget, u *upgradeDecl, id string) (SagaUpgrade, error) {
	in, now, err := a.st.load(ctx, db, id, false)
	if errors.Is(err, errNoSaga) {
		return SagaUpgrade{}, fmt.Errorf("%w: %q", ErrNotFound, id)
	}
	if err != nil {
		return SagaUpgrade{}, err
	}
	plan, err := a.st.checkUpgrade(ctx, db, in, def, u, now)
	if err != nil {
		return SagaUpgrade{}, notUpgradable(id, err)
	}
	return SagaUpgrade{ID: id, UpgradeRecord: plan.rec, Data: plan.in.Data}, nil
}

// UpgradeMatching upgrades the unfinished sagas of def's name and version from to def (as
// UpgradeTx), oldest first, at most o.Limit of them, each in its own transaction, so each is
// upgraded or refused as a whole and one refusal stops nothing else. Refused sagas stay on
// version from, and a later call matches them again (those waiting for a reply may be at a
// boundary by then). With o.DryRun it plans each upgrade — the step mapping and the data
// conversion included — and reports it (Upgraded) or the refusal, and changes nothing.
//
// It needs def, so it runs in the service that has it (an admin endpoint, a one-off command
// of its binary). Operators without it file requests instead: RequestUpgradeMatching, `onceflow
// saga upgrade`.
func (a *Admin) UpgradeMatching(ctx context.Context, db TxDB, def Known, from int, o BulkOptions) (UpgradeResult, error) {
	t, u, err := declaredUpgrade(def, from)
	if err != nil {
		return UpgradeResult{}, err
	}
	res, err := a.selectVersion(ctx, db, def.Name(), from, o)
	if err != nil {
		return res, err
	}
	for _, id := range res.Matched {
		var up SagaUpgrade
		if o.DryRun {
			up, err = a.dryUpgrade(ctx, db, t, u, id)
		} else {
			err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
				var err error
				up, err = a.upgradeTx(ctx, tx, t, u, id)
				return err
			})
		}
		switch {
		case err == nil:
			res.Upgraded = append(res.Upgraded, up)
		case errors.Is(err, ErrNotUpgradable), errors.Is(err, ErrNotFound):
			res.Refused = append(res.Refused, BulkRefusal{ID: id, Err: err})
		default:
			// The database failed: stop, and report what was done so far (each upgrade
			// committed on its own).
			return res, err
		}
	}
	return res, nil
}

// selectVersion lists the unfinished sagas of name and version, oldest first, up to o.Limit.
func (a *Admin) selectVersion(ctx context.Context, db DB, name string, version int, o BulkOptions) (UpgradeResult, error) {
	var res UpgradeResult
	switch {
	case name == "":
		return res, fmt.Errorf("%w: no saga name; name the definition whose sagas to upgrade", ErrBadFilter)
	case version < 1:
		return res, fmt.Errorf("%w: version %d; give the version the sagas run (1 or more)", ErrBadFilter, version)
	case o.Limit == 0:
		o.Limit = 100
	case o.Limit < 0 || o.Limit > MaxBulkLimit:
		return res, fmt.Errorf("%w: limit %d is not between 1 and %d", ErrBadFilter, o.Limit, MaxBulkLimit)
	}
	rows, err := db.Query(ctx, a.st.upgradeSQL().selectVersion, name, version, o.Limit+1)
	if err != nil {
		return res, fmt.Errorf("saga: list the sagas of %s version %d: %w", name, version, a.st.explain(err))
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return res, fmt.Errorf("saga: list the sagas of %s version %d: %w", name, version, a.st.explain(err))
	}
	if len(ids) > o.Limit {
		ids, res.More = ids[:o.Limit], true
	}
	res.Matched = ids
	return res, nil
}

// knownUpgrade returns the newest definition the Admin was given (NewAdmin's defs) of name
// that declares an upgrade from version from — version to, when to is not 0 — or nil.
func (a *Admin) knownUpgrade(name string, from, to int) (upgradeTarget, *upgradeDecl) {
	var best upgradeTarget
	var bu *upgradeDecl
	for k, d := range a.defs {
		if t, ok := d.(upgradeTarget); ok && k.name == name && (to == 0 || k.version == to) && (best == nil || k.version > best.Version()) {
			if u := t.upgradeFrom(from); u != nil {
				best, bu = t, u
			}
		}
	}
	return best, bu
}

// RequestUpgradeTx files a request to upgrade the saga id from version from to version to (0:
// the newest version the orchestrator has that declares an Upgrade from from), which an
// orchestrator that has that definition registered carries out within its TimerInterval, as
// UpgradeTx would; an orchestrator without it leaves the request to another one (it looks at
// it again a minute later). `onceflow saga upgrade` files such requests: the CLI has no
// definitions. The outcome is recorded in the saga's history (Detail.Upgrades, `onceflow
// saga show`): the upgrade, or the refusal and its reason — the saga may have moved on since
// the request was filed.
//
// What the row tells is checked up front, and refused with ErrNotUpgradable: another version,
// a saga not at a step boundary (see UpgradeTx). An Admin given the new definition (NewAdmin's
// defs) also checks the step mapping and the data conversion. A pending retry or compensation
// request of the saga goes first: the upgrade request is refused with ErrWrongState.
func (a *Admin) RequestUpgradeTx(ctx context.Context, tx pgx.Tx, id string, from, to int) error {
	_, err := a.requestUpgrade(ctx, tx, tx, id, from, to)
	return err
}

// requestUpgrade checks an upgrade request and files it in tx; with tx nil (a dry run) it
// reads from db without a lock and files nothing.
func (a *Admin) requestUpgrade(ctx context.Context, db DB, tx pgx.Tx, id string, from, to int) (SagaUpgrade, error) {
	dry := tx == nil
	if from < 1 || (to != 0 && to <= from) {
		return SagaUpgrade{}, fmt.Errorf("%w: an upgrade from version %d to version %d; give the version the saga runs, and a later one (or 0 for the newest)",
			ErrBadFilter, from, to)
	}
	in, now, err := a.st.load(ctx, db, id, !dry)
	if errors.Is(err, errNoSaga) {
		return SagaUpgrade{}, fmt.Errorf("%w: %q", ErrNotFound, id)
	}
	if err != nil {
		return SagaUpgrade{}, err
	}
	up := SagaUpgrade{ID: id, UpgradeRecord: UpgradeRecord{From: in.Version, To: to, Step: summaryOf(in).Step}}
	if t, u := a.knownUpgrade(in.Name, from, to); t != nil {
		plan, err := a.st.checkUpgrade(ctx, db, in, t, u, now)
		if err != nil {
			return up, notUpgradable(id, err)
		}
		up.UpgradeRecord, up.Data = plan.rec, plan.in.Data
	} else {
		why := upgradeBoundary(in)
		if in.Version != from {
			why = fmt.Sprintf("it runs version %d, not %d", in.Version, from)
		}
		if why != "" {
			return up, notUpgradable(id, refuse("%s", why))
		}
	}
	var pending string
	err = db.QueryRow(ctx, a.st.upgradeSQL().pending, id).Scan(&pending)
	switch {
	case errors.Is(err, pgx.ErrNoRows), err == nil && pending == actUpgrade:
	case err != nil:
		return up, fmt.Errorf("saga: the requests of %q: %w", id, a.st.explain(err))
	default:
		return up, refused(ErrWrongState, id, "has a %s request pending, which goes first; file the upgrade once it was carried out", pending)
	}
	if dry {
		return up, nil
	}
	if _, err := tx.Exec(ctx, a.st.upgradeSQL().request, id, from, to); err != nil {
		return up, fmt.Errorf("saga: file the upgrade request for %q: %w", id, a.st.explain(err))
	}
	target := "the newest version"
	if to != 0 {
		target = "version " + strconv.Itoa(to)
	}
	if err := audit.RecordTx(ctx, tx, a.st.schema, audit.SagaUpgrade, []string{id}, fmt.Sprintf("requested from version %d to %s", from, target)); err != nil {
		return up, fmt.Errorf("saga: %w", a.st.explain(err))
	}
	return up, nil
}

// RequestUpgradeMatching files an upgrade request (RequestUpgradeTx) for each unfinished saga
// of name and version from, oldest first, at most o.Limit of them, each in its own
// transaction; a saga the row shows is not at a step boundary is refused with the reason and
// gets no request. With o.DryRun it reports which sagas would get one and which not, and files
// nothing. The step mapping and the data conversion are checked by the orchestrator that
// carries a request out (or up front by an Admin given the definition); its refusals are
// recorded in the saga's history.
func (a *Admin) RequestUpgradeMatching(ctx context.Context, db TxDB, name string, from, to int, o BulkOptions) (UpgradeResult, error) {
	if to != 0 && to <= from {
		return UpgradeResult{}, fmt.Errorf("%w: an upgrade from version %d to version %d; give a later version (or 0 for the newest)", ErrBadFilter, from, to)
	}
	res, err := a.selectVersion(ctx, db, name, from, o)
	if err != nil {
		return res, err
	}
	for _, id := range res.Matched {
		var up SagaUpgrade
		if o.DryRun {
			up, err = a.requestUpgrade(ctx, db, nil, id, from, to)
		} else {
			err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
				var err error
				up, err = a.requestUpgrade(ctx, tx, tx, id, from, to)
				return err
			})
		}
		switch {
		case err == nil:
			res.Requested = append(res.Requested, up)
		case errors.Is(err, ErrNotUpgradable), errors.Is(err, ErrWrongState), errors.Is(err, ErrNotFound):
			res.Refused = append(res.Refused, BulkRefusal{ID: id, Err: err})
		default:
			return res, err
		}
	}
	return res, nil
}

// upgradeTargetFor returns the newest registered definition of name — version to, unless to
// is 0 — that declares an upgrade from version from, or nil.
func (o *Orchestrator) upgradeTargetFor(name string, from, to int) (upgradeTarget, *upgradeDecl) {
	o.mu.RLock()
	defer o.mu.RUnlock()
	var best upgradeTarget
	var bu *upgradeDecl
	for k, d := range o.defs {
		if t, ok := d.(upgradeTarget); ok && k.name == name && (to == 0 || k.version == to) && (best == nil || k.version > best.Version()) {
			if u := t.upgradeFrom(from); u != nil {
				best, bu = t, u
			}
		}
	}
	return best, bu
}

// upgradeRequested carries out an upgrade request (RequestUpgradeTx) whose timer t fired in
// tx, which holds the timer and the saga's row lock; in is the saga. The request is done with
// — the saga upgraded, or the refusal recorded in its history and logged — unless this
// orchestrator lacks the definition to upgrade to: then it is left for another orchestrator
// and looked at again a minute later.
func (o *Orchestrator) upgradeRequested(ctx context.Context, tx pgx.Tx, in *instance, now time.Time, t timer) error {
	from, to := t.Step, t.Attempt
	def, u := o.upgradeTargetFor(in.Name, from, to)
	target := to
	if def != nil {
		target = def.Version()
	}
	log := o.cfg.Logger.With("saga_id", in.ID, "saga", in.Name, "from", from, "to", target)
	why := upgradeBoundary(in)
	if in.Version != from {
		why = fmt.Sprintf("it runs version %d, and the request was to upgrade version %d", in.Version, from)
	}
	if why == "" && def == nil {
		_, err := tx.Exec(ctx, `UPDATE `+pgsql.Table(o.cfg.Schema, "saga_timer")+
			` SET due_at = now() + interval '1 minute' WHERE saga_id = $1 AND kind = 'operator'`, in.ID)
		if err != nil {
			return fmt.Errorf("saga: postpone the upgrade request: %w", o.st.explain(err))
		}
		log.Warn("saga: upgrade request left for another orchestrator: none of the definitions registered here declares the upgrade (saga.Upgrade); looked at again in a minute")
		return nil
	}
	if _, err := tx.Exec(ctx, o.st.delTimer, in.ID, timerOperator); err != nil {
		return fmt.Errorf("saga: delete the upgrade request: %w", o.st.explain(err))
	}
	var plan *upgradePlan
	var err error
	if why == "" {
		plan, err = o.st.checkUpgrade(ctx, tx, in, def, u, now)
		var r *refusal
		switch {
		case errors.As(err, &r):
			why = r.reason
		case err != nil:
			return err
		}
	}
	if why != "" {
		in.recordRefusal(UpgradeRecord{From: in.Version, To: target, At: now, Step: summaryOf(in).Step, Refused: why})
		steps, err := json.Marshal(in.Steps)
		if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, o.st.upgradeSQL().refused, in.ID, steps); err != nil {
			return fmt.Errorf("saga: record the refused upgrade of saga %q: %w", in.ID, o.st.explain(err))
		}
		log.Warn("saga: upgrade refused; the saga goes on unchanged (`onceflow saga show` shows why)", "why", why)
		return nil
	}
	if err := o.st.writeUpgrade(ctx, tx, in.Version, plan); err != nil {
		return err
	}
	log.Info("saga: upgraded", "step", plan.rec.Step, "new_step", plan.rec.NewStep)
	return nil
}
