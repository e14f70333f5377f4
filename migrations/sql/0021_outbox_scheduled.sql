-- onceflow 0021: scheduled outbox messages (outbox.DeliverAt, outbox.DeliverAfter). The schema
-- placeholder is replaced by the configured, validated and quoted schema name. A new table only:
-- nothing existing changes.
--
-- A scheduled message waits here, not in the outbox, until it is due: the relay's claims, the
-- backlog's "oldest pending" and the stuck checks read the outbox only, so a million rows
-- scheduled for tomorrow cost them nothing. A relay moves due rows into the outbox in one
-- transaction (delete here, insert there, same event id), where they get their outbox id — and
-- so their place in their key's order — at their due time. Writers never NOTIFY for a scheduled
-- row; relays look up the next due time through the index on due_at.
CREATE TABLE IF NOT EXISTS {{schema}}.outbox_scheduled (
    event_id      uuid        PRIMARY KEY,               -- the message's id for life; outbox.CancelTx finds it by this
    topic         text        NOT NULL,
    partition_key text        NOT NULL DEFAULT '',
    key_hash      bigint      NOT NULL,
    payload       bytea       NOT NULL,
    metadata      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    due_at        timestamptz NOT NULL,                  -- compared with the database clock
    seq           bigint      GENERATED ALWAYS AS IDENTITY, -- write order among rows due at the same time
    created_at    timestamptz NOT NULL DEFAULT now()
);
-- The relay's next due time (min) and its move of the due rows, in due order.
CREATE INDEX IF NOT EXISTS outbox_scheduled_due_idx ON {{schema}}.outbox_scheduled (due_at, seq);
