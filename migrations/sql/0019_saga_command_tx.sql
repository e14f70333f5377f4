-- onceflow 0019: where a saga's last command is in the outbox, found by an index at any backlog.
-- The schema placeholder is replaced by the configured, validated and quoted schema name.
-- Catalog changes only: nullable columns without a default are added without rewriting or
-- reading the table (instant on a million sagas), and a default set afterwards applies to new
-- rows only.
--
-- The saga's page (saga.Admin.Get: `onceflow saga show`, the console, `saga retry`'s
-- confirmation) says whether a saga's command still waits in the outbox. The outbox has no
-- index on event_id (a second b-tree would cost every business commit), but it has one on tx
-- (0012), the writing transaction: the transition that writes a command records that
-- transaction and the command's event id with the saga row, in the same statement that
-- updates the row (no round trip, no RETURNING), and the lookup reads only that
-- transaction's outbox rows. Sagas whose last command was written before this step (or by an
-- older release during a rolling deploy, which leaves both columns as they were: the event
-- id then no longer matches) are looked up as before.
--
-- The audit trail records the transaction of each action too: an outbox replay moves a parked
-- command back into the outbox under a new id, written by the replay's transaction, which its
-- audit record (targets: the event ids) now names.
--
-- Each ALTER takes ACCESS EXCLUSIVE for an instant; queued behind a long transaction on the
-- table it would hold off every writer queued behind it. It waits at most 5 s for its lock;
-- then the step fails, changes nothing, and running `migrate up` again retries.
SET LOCAL lock_timeout = '5s';
ALTER TABLE {{schema}}.saga ADD COLUMN IF NOT EXISTS command_event uuid;  -- event id of the last command written
ALTER TABLE {{schema}}.saga ADD COLUMN IF NOT EXISTS command_tx xid8;     -- the transaction that wrote it (outbox.tx)
ALTER TABLE {{schema}}.operator_action ADD COLUMN IF NOT EXISTS tx xid8;
ALTER TABLE {{schema}}.operator_action ALTER COLUMN tx SET DEFAULT pg_current_xact_id();
