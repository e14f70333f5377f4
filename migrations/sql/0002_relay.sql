-- onceflow 0002: relay leases, relay membership and parked outbox rows.
-- The schema placeholder is replaced by the configured, validated and quoted schema name.

-- One row per virtual shard. Outbox rows belong to shard key_hash % (number of rows here); a
-- shard is published by one relay at a time, which is what keeps per-key order with several
-- relays. The number of rows is the shard count every relay must be configured with.
CREATE TABLE IF NOT EXISTS {{schema}}.relay_lease (
    shard       integer     PRIMARY KEY CHECK (shard >= 0),
    owner       text        NOT NULL DEFAULT '',          -- relay instance id; '' = free
    epoch       bigint      NOT NULL DEFAULT 0,           -- fencing token: +1 every time the shard is taken
    expires_at  timestamptz NOT NULL DEFAULT 'epoch',     -- compared with the database clock only; 'epoch' = free
    acquired_at timestamptz
);

-- Running relays and their heartbeats. Each relay takes a fair share of the shards according to
-- the members whose heartbeat has not expired, so shards rebalance as relays start, stop or die.
CREATE TABLE IF NOT EXISTS {{schema}}.relay_member (
    id           text        PRIMARY KEY,
    host         text        NOT NULL DEFAULT '',
    pid          integer     NOT NULL DEFAULT 0,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL
);

-- Outbox rows the broker kept refusing, moved aside after the relay's retry limit so the rows
-- behind them can flow. `onceflow outbox replay` moves them back with the same event_id.
CREATE TABLE IF NOT EXISTS {{schema}}.outbox_parked (
    id            bigint      PRIMARY KEY,               -- the row's outbox id when it was parked
    event_id      uuid        NOT NULL,
    topic         text        NOT NULL,
    partition_key text        NOT NULL DEFAULT '',
    key_hash      bigint      NOT NULL,
    payload       bytea       NOT NULL,
    metadata      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at    timestamptz NOT NULL,
    attempts      integer     NOT NULL,
    last_error    text        NOT NULL,
    parked_at     timestamptz NOT NULL DEFAULT now(),
    parked_by     text        NOT NULL DEFAULT ''        -- relay instance id
);
CREATE INDEX IF NOT EXISTS outbox_parked_event_id_idx ON {{schema}}.outbox_parked (event_id);
CREATE INDEX IF NOT EXISTS outbox_parked_topic_idx ON {{schema}}.outbox_parked (topic, id);
