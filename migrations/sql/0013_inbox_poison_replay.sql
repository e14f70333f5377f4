-- onceflow 0013: replay of the inbox's given-up messages (`onceflow inbox poison replay`). The
-- schema placeholder is replaced by the configured, validated and quoted schema name. New
-- columns with defaults (no table rewrite), one partial index, and a backfill of the rows no
-- replay may apply.
--
-- A replay is a request the consumer's own processes apply, in their own transaction keyed on
-- their own dedup key, so no other consumer group of the topic sees the message again (a
-- re-publish to the topic would reach them all). The request and the row's state change are
-- one UPDATE (state 'poison' -> 'replay_requested'), so a second request of the same row finds
-- it in another state and is refused. The consumer then, in ONE transaction, marks the row
-- 'replayed', removes the message's dedup row, and runs the message through its engine, which
-- claims the key again: all of it commits, or none. A replay whose handler fails again puts the
-- row back in 'poison' with its attempts, replays and error updated and its dedup row kept.
ALTER TABLE {{schema}}.inbox_poison
    ADD COLUMN IF NOT EXISTS state text NOT NULL DEFAULT 'poison'
        CONSTRAINT inbox_poison_state_check CHECK (state IN ('poison', 'replay_requested', 'replayed')),
    -- The Watermill handler a router consumer's message failed in, and its publish topic: a
    -- replay runs that handler again (router.Handlers()[handler]). '' for batched consumers.
    ADD COLUMN IF NOT EXISTS handler             text        NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS publish_topic       text        NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS replays             integer     NOT NULL DEFAULT 0,  -- replays applied (successful or failed)
    ADD COLUMN IF NOT EXISTS replay_requested_at timestamptz,
    ADD COLUMN IF NOT EXISTS replay_requested_by text,
    ADD COLUMN IF NOT EXISTS replayed_at         timestamptz,                     -- when the last replay succeeded
    -- Why no replay may apply this row (a saga's reply or command), NULL when one may.
    ADD COLUMN IF NOT EXISTS replay_refusal      text,
    -- One object per event: {"at", "event" (requested | replayed | failed), "by", "error", "attempts"}.
    ADD COLUMN IF NOT EXISTS history             jsonb       NOT NULL DEFAULT '[]'::jsonb;

-- The consumers look for requests a few seconds apart: a partial index holds only the rows
-- waiting, so the look-up costs the same with 10 rows or 10 million in the table.
CREATE INDEX IF NOT EXISTS inbox_poison_replay_idx ON {{schema}}.inbox_poison (consumer, id) WHERE state = 'replay_requested';

-- Rows the saga engine gave up on before this step carry no refusal yet. A reply (it has an
-- outcome) set its saga stuck: `onceflow saga retry` is its recovery, not a replay. A command
-- (it has a reply topic) was recorded as poison only when it was not a valid command of its
-- participant, which a replay cannot change. Rows of plain consumers carry neither key.
UPDATE {{schema}}.inbox_poison
   SET replay_refusal = CASE WHEN metadata ? 'saga_outcome'
       THEN 'a saga reply: its saga was set stuck when it was given up; resume the saga with `onceflow saga retry ' || (metadata->>'saga_id') || '` (a replay would apply an old reply to a saga that moved on)'
       ELSE 'a saga command that is not valid for its participant: a replay would fail the same way; fix the sender, then `onceflow saga retry ' || coalesce(metadata->>'saga_id', '<saga id>') || '`' END
 WHERE replay_refusal IS NULL AND state = 'poison' AND (metadata ? 'saga_outcome' OR metadata ? 'saga_reply_to');
