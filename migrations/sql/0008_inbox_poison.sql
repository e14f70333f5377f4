-- onceflow 0008: messages a batched consumer gave up on. The schema placeholder is replaced by
-- the configured, validated and quoted schema name. A new table only.

-- One row per message that kept failing after its attempts (or could never succeed: no dedup
-- key, an invalid message). It is written in the same transaction as the message's dedup row,
-- so the consumer moves past the message exactly once and a redelivery is skipped; the row
-- keeps what is needed to inspect and replay it (`onceflow inbox poison`). Rows stay until an
-- operator deletes them: they are not dedup records and no cleaner removes them.
CREATE TABLE IF NOT EXISTS {{schema}}.inbox_poison (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer     text        NOT NULL,
    dedup_key    text,                                    -- NULL when the message had none
    message_uuid text        NOT NULL,
    source       text        NOT NULL DEFAULT '',         -- where it came from, e.g. topic/partition@offset
    metadata     jsonb       NOT NULL DEFAULT '{}'::jsonb,
    payload      bytea       NOT NULL,
    attempts     integer     NOT NULL,
    error        text        NOT NULL,
    failed_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS inbox_poison_consumer_idx ON {{schema}}.inbox_poison (consumer, id);
