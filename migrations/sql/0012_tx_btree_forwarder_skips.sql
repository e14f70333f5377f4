-- onceflow 0012: late commits found through a b-tree on tx again, with nothing for the relay to
-- maintain; and the rows `migrate from-forwarder` sets aside. The schema placeholder is
-- replaced by the configured, validated and quoted schema name.
--
-- Step 0007's BRIN index needed the relay to summarize it (brin_summarize_range), which takes
-- SHARE UPDATE EXCLUSIVE on the outbox inside the claim path: while anything else held that
-- lock (a manual VACUUM or ANALYZE, an anti-wraparound autovacuum, CREATE INDEX CONCURRENTLY)
-- every claim waited, and delivery stopped; a summary that waited behind a plain autovacuum
-- for deadlock_timeout cancelled it. Its lookups also read the index's whole summary and the
-- unsummarized tail, so claims slowed down as the table grew, and the writers did not measurably
-- gain from it (docs/PERFORMANCE.md, write_concurrent). A b-tree on tx alone (not (tx, id):
-- the rows of one transaction share a key, which b-tree deduplication stores once) is found
-- by two index range scans whose cost depends only on the transactions looked up, and
-- PostgreSQL keeps it up to date by itself.
--
-- The build holds off writers while it reads the outbox once, which is brief on a drained
-- outbox. On a large backlog, build it by hand first without blocking them
-- (CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_tx_idx ON <schema>.outbox (tx)): this step
-- then finds it and only drops the BRIN index. Relays of an earlier release look late commits
-- up through the BRIN index: upgrade them together with this step.
--
-- The build takes SHARE on the outbox and the DROP INDEX ACCESS EXCLUSIVE: queued behind a long
-- transaction that touched the outbox, either would hold off every writer and relay queued
-- behind it. Each waits at most 5 s for its lock; then the step fails, changes nothing, and
-- running `migrate up` again retries.
SET LOCAL lock_timeout = '5s';
CREATE INDEX IF NOT EXISTS outbox_tx_idx ON {{schema}}.outbox (tx);
DROP INDEX IF EXISTS {{schema}}.outbox_tx_brin;
DROP FUNCTION IF EXISTS {{schema}}.outbox_summarize(bigint, bigint);

-- Rows `onceflow migrate from-forwarder --skip-unmovable` set aside instead of moving them (not
-- a forwarder envelope, or a payload over its limit): kept whole, with the reason, so nothing
-- leaves the forwarder's table without a trace, and reported by the move.
CREATE TABLE IF NOT EXISTS {{schema}}.forwarder_move_skipped (
    source         text        NOT NULL,                 -- as forwarder_move.source
    "offset"       bigint      NOT NULL,                 -- the row's offset in the forwarder's table
    transaction_id text        NOT NULL DEFAULT '',      -- default adapter: the row's transaction_id (offsets repeat across them)
    uuid           text        NOT NULL,                 -- the row's uuid column
    envelope       bytea       NOT NULL,                 -- the row's payload column: the forwarder's envelope as stored
    reason         text        NOT NULL,
    skipped_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, "offset", transaction_id)
);
