// Package saga runs orchestrated sagas: multi-step workflows whose steps and compensations
// travel as commands and replies through the outbox and the inbox, so that every step's
// effect happens exactly once however often a message is delivered.
//
// A saga is defined once, typed by its data D, as a list of steps:
//
//	checkout, err := saga.Define("checkout", 1, []*saga.StepDef[Checkout]{
//		saga.Step[Checkout]("reserve").Send("inventory.reserve", reserveCmd).
//			OnReply(keepReservation).Compensate("inventory.release", releaseCmd).Timeout(30 * time.Second),
//		saga.Step[Checkout]("charge").Send("payments.charge", chargeCmd).Pivot(),
//		saga.Step[Checkout]("confirm").Local(confirmOrder),
//	})
//
// and started in the business transaction that decides it (StartTx, StartSQLTx): the saga
// row and its first command commit with the order, or not at all.
//
// The Orchestrator drives the sagas: Handler (per message, under a Watermill router) or
// ProcessBatch (inbox/inboxkafka.BatchConsumer) applies the participants' replies, Run fires
// the durable timers (step timeouts, re-sends, deadlines, operator requests). Each transition
// — the reply's dedup row, the saga row (locked), the next command in the outbox, the timers,
// and any local step or OnReplyTx handler — commits in one transaction. Steps are run in
// order and compensated in reverse; a step's business failure (Fail) compensates the steps
// before it, a transient one (Retry) is re-sent as a new attempt within the step's attempts.
//
// A Participant turns typed step handlers into consumers (Action, Compensation and
// CompensationFor per message; ActionProcessor, CompensationProcessor and
// CompensationForProcessor for the batched consumer). Each command runs in one transaction
// with its dedup row, the barrier's records and its reply, so a duplicated, late or reordered
// command acts at most once: a compensation whose action never ran is a no-op, an action
// arriving after its compensation is skipped, and a later attempt of an action that took
// effect is answered with the result the first one kept.
//
// Per message or batched, each consumer has one engine: the per-message handlers are the
// batch engine given a batch of one. A failure of a transaction as a whole — the database
// unreachable or restarting, a deadlock with another batch over hot rows, a lock timeout — is
// retried without counting an attempt; a handler's own error counts one, and after its
// attempts a command is answered as a failed attempt and a reply sets its saga stuck, so a
// partition never wedges. An operator sees stuck sagas with `onceflow saga list` and resumes
// them with `onceflow saga retry`, which goes on the way the saga was going: forward by
// re-sending the step's command, or on with its compensation.
//
// A saga runs to its end on the definition version it started with, unless a newer version
// declares how to take it over (Upgrade: a data conversion and a StepMap): then
// Admin.UpgradeMatching, or `onceflow saga upgrade` through an orchestrator, moves it onto
// the new version in one transaction, at a step boundary (no command in flight).
//
// See docs/sagas.md for the whole guide: definitions, participants, local steps, timers,
// batching and hot rows, operations.
package saga
