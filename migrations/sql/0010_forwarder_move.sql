-- onceflow 0010: the bookkeeping of `onceflow migrate from-forwarder` (outbox/fromforwarder),
-- which moves the pending rows of a Watermill forwarder's watermill-sql table into the outbox.
-- The schema placeholder is replaced by the configured, validated and quoted schema name.

-- One row per forwarder table (and consumer group) moved from. The first run records where
-- the forwarder stood before anything was moved, so the way back (resetting the forwarder's
-- offset to start_*) stays known after interrupted and repeated runs; each batch adds its
-- rows in the transaction that moves them, so moved is exact whatever was killed when.
CREATE TABLE IF NOT EXISTS {{schema}}.forwarder_move (
    source               text        PRIMARY KEY,          -- '<adapter> <table as written> <consumer group>'
    start_transaction_id text        NOT NULL,             -- default adapter: the group's last_processed_transaction_id before the first move
    start_offset         bigint      NOT NULL,             -- default adapter: its offset_acked; queue adapter: the first moved row's offset
    moved                bigint      NOT NULL DEFAULT 0,   -- rows moved, over every run
    first_event_id       uuid,                             -- the first moved message's Watermill UUID
    last_event_id        uuid,                             -- the last one's
    started_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now()
);
