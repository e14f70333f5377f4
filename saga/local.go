package saga

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/failure"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/outbox"
)

// LocalRun describes the saga a local step, local compensation or ending hook (OnCompleted,
// OnCompensated) runs for; read it with LocalRunFrom in that function.
type LocalRun struct {
	// ID, Name and Version identify the saga and its definition.
	ID      string
	Name    string
	Version int
	// Step and Phase name the step being run; both are empty in an ending hook.
	Step  string
	Phase outbox.SagaPhase
	// Attempt is the run's number (1 for the first run); 0 in an ending hook.
	Attempt int
	// Error is the saga's error: why it compensates (a participant's failure, a local step's
	// saga.Fail, a deadline, an operator), empty while it goes forward. The saga row is
	// stored after the function returns, so this, not the row, is the current reason.
	Error string
}

type localRunKey struct{}

// LocalRunFrom returns the saga that the local function ctx was given to runs for: a local
// step's action or compensation, or an ending hook. ok is false for any other context.
func LocalRunFrom(ctx context.Context) (r LocalRun, ok bool) {
	r, ok = ctx.Value(localRunKey{}).(LocalRun)
	return r, ok
}

func withLocalRun(ctx context.Context, in *instance, step string, phase outbox.SagaPhase, attempt int) context.Context {
	return context.WithValue(ctx, localRunKey{}, LocalRun{ID: in.ID, Name: in.Name, Version: in.Version,
		Step: step, Phase: phase, Attempt: attempt, Error: in.Error})
}

var errLocalTxManaged = fmt.Errorf("%w (saga local step: the orchestrator commits it with the saga's transition; to abort, return an error)", outbox.ErrTxManaged)

// runLocals is the store layer's half of local steps: while the machine asks for a local run
// (fx.local), it runs that step in tx and feeds the outcome back, so consecutive local steps
// run in this one transition, until a remote step sends its command, a run failed (a re-run
// timer is set) or the saga ended. Then, when the saga ended, the definition's end hook
// (OnCompleted, OnCompensated) runs in tx. An error is the transition's: tx must be rolled
// back.
func runLocals(ctx context.Context, tx pgx.Tx, m *machine) error {
	for m.fx.local != nil {
		r := *m.fx.local
		m.fx.local = nil
		data, stepErr, err := runLocalStep(ctx, tx, m.def, m.in, r)
		if err != nil {
			return fmt.Errorf("saga %q (%s): local step %q: %w", m.in.ID, m.in.Name, m.def.step(r.Step).name, err)
		}
		if err := m.local(r, localOutcome{Data: data, Err: stepErr}); err != nil {
			return fmt.Errorf("saga %q (%s): %w", m.in.ID, m.in.Name, err)
		}
	}
	if m.fx.finished == "" {
		return nil
	}
	view, done := pgsql.ManagedTx(tx, errLocalTxManaged)
	data, ran, err := m.def.runEnd(withLocalRun(ctx, m.in, "", "", 0), view, m.fx.finished, m.in.Data)
	if misuse := done(); misuse != nil && err == nil {
		err = misuse
	}
	if err != nil {
		return fmt.Errorf("saga %q (%s): the %s hook: %w", m.in.ID, m.in.Name, m.fx.finished, err)
	}
	if ran {
		m.in.Data = data
	}
	return nil
}

// runLocalStep runs one local run in a savepoint of tx: on success the savepoint is
// released and the new data returned; when the step fails (stepErr), its writes are rolled
// back to the savepoint and tx goes on. err, when set, fails the whole transition: a
// transient database error (a deadlock, a lost connection: tried again, no attempt counted)
// or a transaction the step ended.
//
// One savepoint per local run: a transition runs a few local steps, far from the 64
// subtransactions per transaction beyond which PostgreSQL's per-backend subtransaction cache
// overflows (DESIGN.md, Known traps). That trap is about a savepoint per message in large
// batches, which remote steps and sagas without local steps never take. A batch of replies
// (ProcessBatch) or timers (at most TimerBatch, 60) takes one per local run of each of its
// sagas: the orchestrator splits such batches (ProcessBatch, and the timer batch) so that one
// transaction takes at most 60 (Orchestrator.perTransaction).
func runLocalStep(ctx context.Context, tx pgx.Tx, def definition, in *instance, r localRun) (data json.RawMessage, stepErr, err error) {
	if _, err := tx.Exec(ctx, `SAVEPOINT onceflow_saga_local`); err != nil {
		return nil, nil, err
	}
	view, done := pgsql.ManagedTx(tx, errLocalTxManaged)
	data, stepErr = def.runLocal(withLocalRun(ctx, in, def.step(r.Step).name, r.Phase, r.Attempt), view, r.Step, r.Phase, in.Data)
	if misuse := done(); misuse != nil && stepErr == nil {
		stepErr = misuse
	}
	if stepErr == nil {
		if _, err := tx.Exec(ctx, `RELEASE SAVEPOINT onceflow_saga_local`); err != nil {
			return nil, nil, err
		}
		return data, nil, nil
	}
	if outcomeOf(stepErr) == nil && !stepsFailure(ctx, stepErr, tx) {
		// Not the step's failure: the transaction's (a deadlock, the connection lost), or
		// the consumer stops (a rebalance, a shutdown). No run is counted; the transition is
		// tried again.
		return nil, nil, stepErr
	}
	if _, err := tx.Exec(ctx, `ROLLBACK TO SAVEPOINT onceflow_saga_local`); err != nil {
		return nil, nil, fmt.Errorf("roll back its writes after %w: %w", stepErr, err)
	}
	return nil, stepErr, nil
}

// stepsFailure reports whether err, returned by a local step or an OnReplyTx handler run in tx
// under ctx, is the step's by the engine's rule (failure.Whose): everything but a failure of
// the transaction's own connection or server and the consumer stopping — an HTTP client's
// error, a deadline, a decoder's EOF count the step's attempts like any other error.
func stepsFailure(ctx context.Context, err error, tx pgx.Tx) bool {
	return failure.Whose(ctx, err, tx.Conn()) == failure.Message
}

// runReplyTx returns the machine's replyTx for a transition in tx: it runs a step's
// OnReplyTx handler in a savepoint of tx, as runLocalStep runs a local step. The handler's
// own error rolls its writes back and is returned (the step is compensated); a transient
// database error, the context's end or a failed rollback comes back as a transitionError,
// which fails the whole transition.
func runReplyTx(ctx context.Context, tx pgx.Tx, def definition, in *instance) func(int, json.RawMessage, Reply) (json.RawMessage, error) {
	return func(idx int, raw json.RawMessage, r Reply) (json.RawMessage, error) {
		if _, err := tx.Exec(ctx, `SAVEPOINT onceflow_saga_reply`); err != nil {
			return nil, transitionError{err}
		}
		view, done := pgsql.ManagedTx(tx, errLocalTxManaged)
		data, err := def.onReplyTx(withLocalRun(ctx, in, def.step(idx).name, outbox.SagaPhaseAction, r.Attempt), view, idx, raw, r)
		if misuse := done(); misuse != nil && err == nil {
			err = misuse
		}
		if err == nil {
			if _, err := tx.Exec(ctx, `RELEASE SAVEPOINT onceflow_saga_reply`); err != nil {
				return nil, transitionError{err}
			}
			return data, nil
		}
		if !stepsFailure(ctx, err, tx) {
			return nil, transitionError{err}
		}
		if _, rbErr := tx.Exec(ctx, `ROLLBACK TO SAVEPOINT onceflow_saga_reply`); rbErr != nil {
			return nil, transitionError{fmt.Errorf("roll back its writes after %w: %w", err, rbErr)}
		}
		return nil, err
	}
}
