-- onceflow 0022: the inbox's retry lane (inbox.RetryAfter). The schema placeholder is replaced by
-- the configured, validated and quoted schema name. A new table only: nothing existing changes.
--
-- A message whose handler returned inbox.RetryAfter(err, d) is parked here, in one transaction
-- with its dedup row (so a redelivery is a duplicate), and its partition moves on. Later
-- messages of its lane — the same consumer, topic and partition key — are parked behind it in
-- the transaction that would have applied them, so they are never applied ahead of it; other
-- keys go on. When the head of a lane is due, a process of the consumer applies it in a
-- transaction that also deletes its row, so it is applied exactly once, and makes the next
-- message of the lane due at once. Rows are not dedup records: no cleaner removes them; they
-- leave when applied or given up (moved to inbox_poison after the lane's attempts).
CREATE TABLE IF NOT EXISTS {{schema}}.inbox_parked (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY, -- order within a lane
    consumer      text        NOT NULL,
    topic         text        NOT NULL,                 -- the topic it was consumed from
    lane          text,                                 -- its partition key; NULL: none (parked alone)
    dedup_key     text        NOT NULL,
    message_uuid  text        NOT NULL,
    source        text        NOT NULL DEFAULT '',      -- e.g. topic/partition@offset
    handler       text        NOT NULL DEFAULT '',      -- a router consumer's handler; '' batched
    publish_topic text        NOT NULL DEFAULT '',
    metadata      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    payload       bytea       NOT NULL,
    attempts      integer     NOT NULL DEFAULT 0,       -- failed attempts so far
    error         text        NOT NULL DEFAULT '',      -- the last one's error; '' for a row parked behind
    due_at        timestamptz,                          -- NULL: it waits behind an earlier row of its lane
    parked_at     timestamptz NOT NULL DEFAULT now()
);
-- Each consumer transaction asks whether its messages' lanes hold parked rows (one probe per
-- lane, through the last row of the lane, which it locks against a drain that would empty the
-- lane meanwhile).
CREATE INDEX IF NOT EXISTS inbox_parked_lane_idx ON {{schema}}.inbox_parked (consumer, topic, lane, id) WHERE lane IS NOT NULL;
-- The heads that are due: only a lane's head carries due_at.
CREATE INDEX IF NOT EXISTS inbox_parked_due_idx ON {{schema}}.inbox_parked (consumer, due_at) WHERE due_at IS NOT NULL;
-- Retention keeps the dedup row of a parked message (inbox.Cleaner).
CREATE INDEX IF NOT EXISTS inbox_parked_key_idx ON {{schema}}.inbox_parked (consumer, dedup_key);
