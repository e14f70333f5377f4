package saga

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/audit"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/outbox"
)

// What an unfinished saga waits for (Wait.For).
const (
	// WaitRelay: the current command is still in the outbox; no relay has published it yet
	// (none runs, or the row waits behind others of its shard or is being retried).
	WaitRelay = "relay"
	// WaitParked: the relay parked the current command (the broker refused it for good); it
	// moves again after `onceflow outbox replay`.
	WaitParked = "parked"
	// WaitReply: the current command left the outbox (published); the participant's reply has
	// not been applied yet.
	WaitReply = "reply"
	// WaitResend: the last attempt failed; the command is re-sent, as the next attempt, at Due.
	WaitResend = "resend"
	// WaitRun: a local first step runs when an orchestrator's Run fires its timer, due at
	// the start (StartTx without RunLocalSteps).
	WaitRun = "run"
	// WaitOperator: the saga is stuck; it waits for `onceflow saga retry` once the cause is fixed.
	WaitOperator = "operator"
	// WaitVersion: replies of the saga reached orchestrators that lack its definition version
	// and were parked; the saga awaits an orchestrator with definition Wait.Definition version
	// Wait.Version registered, which applies them in order (a rolling deploy: docs/sagas.md,
	// "Rolling deploys: versions side by side").
	WaitVersion = "version"
)

// Wait says what an unfinished saga waits for: its current command, where that command is,
// and the timer that ends the wait.
type Wait struct {
	// For is WaitRelay, WaitParked, WaitReply, WaitResend, WaitRun, WaitOperator or
	// WaitVersion.
	For string
	// Local is set when the step's phase waited on is local: it runs in an orchestrator's
	// transaction, so the saga waits only for a re-run (WaitResend), its first run (WaitRun)
	// or an operator, never for a relay or a reply.
	Local bool
	// Step, Phase and Attempt name the command waited on: the one sent last (for WaitResend,
	// the attempt that failed; the re-send will be Attempt+1). For WaitOperator, Phase is the
	// way the saga was going when it stopped — action: forward, compensation: undoing — which
	// is what `onceflow saga retry` re-sends, as attempt Attempt+1. Attempt counts every command
	// of the step's phase, as the command's metadata and the COMMANDS list do.
	Step    string
	Phase   outbox.SagaPhase
	Attempt int
	// Topic, EventID and Since: where the command went, with which event id, and when it was
	// written to the outbox (zero when the saga has no record of it).
	Topic   string
	EventID string
	Since   time.Time
	// Due is when the step's timer ends the wait: the reply timeout (WaitRelay, WaitReply)
	// or the re-send (WaitResend); nil when the step has no timeout.
	Due *time.Time
	// PublishAttempts and PublishError: the relay's failed attempts to publish the command
	// and its last error (WaitRelay, WaitParked).
	PublishAttempts int
	PublishError    string
	// LastError is the step's last failure (WaitResend, WaitOperator); for WaitVersion, the
	// last error of an orchestrator that has the version and failed to apply the oldest
	// parked reply ("" when none tried).
	LastError string
	// Definition and Version name, for WaitVersion, what the saga awaits: an orchestrator with
	// that definition version registered (the saga's own name and version). Parked counts its
	// parked replies; Since is then when the oldest of them parked.
	Definition string
	Version    int
	Parked     int
}

// parkedInfo is what Admin.Get read of a saga's parked replies.
type parkedInfo struct {
	count     int
	since     *time.Time
	lastError string
}

// wait derives what in waits for from its row, timers and parked replies, then looks the
// current command up in the outbox and outbox_parked when the saga waits for its reply: by
// index probes (findCommand), or for a saga row without a record of where its command was
// written, by event id (scanForCommand).
func (a *Admin) wait(ctx context.Context, db DB, in *instance, timers []Timer, parked parkedInfo) (*Wait, error) {
	if in.State.Finished() || in.Step < 0 || in.Step >= len(in.Steps) {
		return nil, nil
	}
	rec := in.Steps[in.Step]
	w := &Wait{Step: rec.Name, Phase: in.phase(), Attempt: in.Attempt, LastError: rec.LastError}
	if in.State == StateStuck {
		w.Phase = in.stuckPhase() // what it was doing, and what `saga retry` re-sends
	}
	w.Local = (w.Phase == outbox.SagaPhaseAction && rec.Local) || (w.Phase == outbox.SagaPhaseCompensation && rec.LocalCompensation)
	for i := len(rec.Sent) - 1; i >= 0; i-- {
		if c := rec.Sent[i]; c.Phase == w.Phase && c.Attempt == in.Attempt {
			w.Topic, w.EventID, w.Since = c.Topic, c.EventID, c.At
			break
		}
	}
	for _, t := range timers {
		if t.Kind == timerStep {
			due := t.Due
			w.Due = &due
		}
	}
	switch {
	case in.State == StateStuck:
		w.For, w.Due = WaitOperator, nil
		return w, nil
	case parked.count > 0:
		w.For, w.Definition, w.Version, w.Parked, w.LastError = WaitVersion, in.Name, in.Version, parked.count, parked.lastError
		if parked.since != nil {
			w.Since = *parked.since
		}
		return w, nil
	case in.Waiting == waitResend:
		w.For = WaitResend
		return w, nil
	case in.Waiting == waitRun:
		w.For = WaitRun
		return w, nil
	}
	w.For, w.LastError = WaitReply, ""
	if w.EventID == "" {
		return w, nil
	}
	where, found, err := a.findCommand(ctx, db, in.ID, w)
	if err == nil && !found {
		where, err = a.scanForCommand(ctx, db, w)
	}
	if err != nil {
		return nil, fmt.Errorf("saga: look up the command %s of saga %q in the outbox: %w", w.EventID, in.ID, a.st.explain(err))
	}
	switch where {
	case "pending":
		w.For = WaitRelay
	case "parked":
		w.For = WaitParked
	}
	return w, nil
}

// findCommand looks the saga's current command up where the saga row says it was written:
// the row records the event id of the last command the saga wrote and the transaction that
// wrote it (command_event, command_tx: store.update, migration 0019), and the outbox has a
// b-tree on tx (the relay's late-commit index, 0012), so the probe reads only that
// transaction's outbox rows — one, or a batch's commands — however large and old the relay's
// backlog is. A command the relay parked is found by outbox_parked's index on event_id; one an
// operator replayed from there is back in the outbox under a new id and the replay's
// transaction, which the replay's audit record names (operator_action.tx, found by the
// targets index). where is "pending", "parked" or "" (published). found is false when the
// row has no such record of this command (written before migration 0019, or by an older
// release that leaves the record as it was): scanForCommand looks then.
func (a *Admin) findCommand(ctx context.Context, db DB, id string, w *Wait) (where string, found bool, err error) {
	var pending, parked *int
	var pendingErr, parkedErr *string
	err = db.QueryRow(ctx, a.st.findCommand, id, w.EventID, audit.OutboxReplay).Scan(&pending, &pendingErr, &parked, &parkedErr)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return "", false, nil
	case err != nil:
		return "", false, err
	case pending != nil:
		w.PublishAttempts, w.PublishError = *pending, *pendingErr
		return "pending", true, nil
	case parked != nil:
		w.PublishAttempts, w.PublishError = *parked, *parkedErr
		return "parked", true, nil
	}
	return "", true, nil
}

// findCommandSQL is findCommand's statement: $1 the saga id, $2 the command's event id, $3
// audit.OutboxReplay. No row when the saga row does not record that command.
func findCommandSQL(schema string) string {
	return `SELECT o.attempts, o.last_error, p.attempts, p.last_error FROM ` + pgsql.Table(schema, "saga") + ` s
		LEFT JOIN LATERAL (SELECT attempts, coalesce(last_error, '') AS last_error FROM ` + pgsql.Table(schema, "outbox") + `
			WHERE event_id = s.command_event AND tx = ANY (array_prepend(s.command_tx, ARRAY(
				SELECT r.tx FROM ` + pgsql.Table(schema, "operator_action") + ` r
				WHERE r.targets @> ARRAY[s.command_event::text] AND r.action = $3 AND r.tx IS NOT NULL)))
			LIMIT 1) o ON true
		LEFT JOIN LATERAL (SELECT attempts, last_error FROM ` + pgsql.Table(schema, "outbox_parked") + `
			WHERE event_id = s.command_event LIMIT 1) p ON true
		WHERE s.id = $1 AND s.command_event = $2::uuid AND s.command_tx IS NOT NULL`
}

// scanForCommand looks a command up by event id alone, for a saga row that does not record
// where its command was written (findCommand). The outbox has no index on event_id (a second
// b-tree would cost every business commit): the lookup scans the pending rows. It is skipped
// when the oldest pending row (one probe of the primary key) was written well after the
// command (commandMargin): the relay has published everything from then on, the command
// included. Only such a saga whose command is older than the relay's backlog pays the scan.
func (a *Admin) scanForCommand(ctx context.Context, db DB, w *Wait) (string, error) {
	outboxT, parkedT := pgsql.Table(a.st.schema, "outbox"), pgsql.Table(a.st.schema, "outbox_parked")
	published := false // known without a scan of the outbox
	if !w.Since.IsZero() {
		// Its own statement: under a one-time filter the scan would still be planned in
		// parallel, and its workers started for nothing (tens of ms on a busy server).
		if err := db.QueryRow(ctx, `SELECT coalesce((SELECT created_at FROM `+outboxT+` ORDER BY id LIMIT 1) > $1::timestamptz + $2::interval, true)`,
			w.Since, commandMargin).Scan(&published); err != nil {
			return "", err
		}
	}
	pending := `SELECT 'pending', attempts, coalesce(last_error, '') FROM ` + outboxT + ` WHERE event_id = $1::uuid UNION ALL `
	if published {
		pending = ""
	}
	var where string
	err := db.QueryRow(ctx, pending+`SELECT 'parked', attempts, last_error FROM `+parkedT+` WHERE event_id = $1::uuid LIMIT 1`,
		w.EventID).Scan(&where, &w.PublishAttempts, &w.PublishError)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil // published
	}
	return where, err
}

// commandMargin is how much later than a command the oldest pending outbox row must have been
// written for the command to count as published without looking it up: rows are numbered as
// they are inserted, but stamped with their transaction's start, so a row inserted before the
// command's can be stamped a transaction's length later.
const commandMargin = 5 * time.Minute
