-- onceflow 0001: outbox, inbox dedup, HTTP idempotency records.
-- The schema placeholder is replaced by the configured, validated and quoted schema name.

-- Pending domain events. A row exists iff its business transaction committed (guarantee 1);
-- the relay deletes it only after the broker acknowledged it (guarantee 2).
CREATE TABLE IF NOT EXISTS {{schema}}.outbox (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY, -- claim order
    event_id      uuid        NOT NULL,                  -- Watermill message UUID, minted once (UUIDv7)
    topic         text        NOT NULL,
    partition_key text        NOT NULL DEFAULT '',       -- Kafka key; '' means none
    key_hash      bigint      NOT NULL,                  -- FNV-1a 32 of the key (of event_id when no key): virtual shard = key_hash % shards
    payload       bytea       NOT NULL,
    metadata      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at    timestamptz NOT NULL DEFAULT now(),
    attempts      integer     NOT NULL DEFAULT 0,        -- failed publish attempts so far
    last_error    text
);

-- Consumed messages (inbox). One row per (consumer, dedup key), written in the same
-- transaction as the handler's effect (guarantee 5).
CREATE TABLE IF NOT EXISTS {{schema}}.processed_event (
    consumer     text        NOT NULL,
    dedup_key    text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, dedup_key)
);
-- Retention deletes by age in batches (guarantee 8).
CREATE INDEX IF NOT EXISTS processed_event_processed_at_idx
    ON {{schema}}.processed_event (processed_at);

-- Stored first responses of HTTP commands, scoped per owner (guarantee 7).
CREATE TABLE IF NOT EXISTS {{schema}}.idempotency_record (
    owner       text        NOT NULL,
    idem_key    text        NOT NULL,
    fingerprint bytea       NOT NULL,                    -- SHA-256 over method, route, query, body
    status      integer     NOT NULL,
    headers     jsonb       NOT NULL DEFAULT '{}'::jsonb, -- allow-listed response headers
    body        bytea,                                   -- NULL when the response exceeded the storage cap
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (owner, idem_key)
);
CREATE INDEX IF NOT EXISTS idempotency_record_expires_at_idx
    ON {{schema}}.idempotency_record (expires_at);
