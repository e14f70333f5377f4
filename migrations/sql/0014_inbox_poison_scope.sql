-- onceflow 0014: a replay runs in the consumer that gave the message up, and a replay that
-- finds its message applied already says so. The schema placeholder is replaced by the
-- configured, validated and quoted schema name. A new column with a default (no table
-- rewrite), a backfill of the rows given up before it, and a wider state check.
--
-- topic is the topic the message was consumed from. A router consumer's replay runs in the
-- handler named by `handler`; a batched consumer's (handler '') runs in the batched consumer
-- of that topic only, so two batched consumers that share a consumer name (an Inbox used for
-- two topics) never run each other's messages through the wrong handler.
ALTER TABLE {{schema}}.inbox_poison
    ADD COLUMN IF NOT EXISTS topic text NOT NULL DEFAULT '';

-- Rows written before this step: a router row's source is its topic; a batched consumer's is
-- topic/partition@offset (Kafka topic names contain no '/').
UPDATE {{schema}}.inbox_poison
   SET topic = CASE WHEN handler <> '' THEN source ELSE split_part(source, '/', 1) END
 WHERE topic = '';

-- 'duplicate': the replay found the message's dedup key recorded by another delivery that
-- committed meanwhile; the handler did not run again, and the row is not replayed again.
ALTER TABLE {{schema}}.inbox_poison DROP CONSTRAINT IF EXISTS inbox_poison_state_check;
ALTER TABLE {{schema}}.inbox_poison
    ADD CONSTRAINT inbox_poison_state_check CHECK (state IN ('poison', 'replay_requested', 'replayed', 'duplicate'));
