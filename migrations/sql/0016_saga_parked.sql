-- onceflow 0016: replies parked for an orchestrator that has their saga's definition version.
-- The schema placeholder is replaced by the configured, validated and quoted schema name.
--
-- In a rolling deploy, orchestrators with different registered versions of a definition share
-- one consumer group: a reply of a version-2 saga may reach an orchestrator that has only
-- version 1. That is not the reply's fault, so it is neither retried nor given up: the
-- orchestrator claims its dedup key and parks it here, in one transaction. An orchestrator
-- that has the version applies the saga's parked replies in arrival order (Orchestrator.Run),
-- in the transaction that deletes them, and without a dedup check: the key was claimed when
-- the reply parked, so a redelivery of it is a duplicate. A later reply of a saga that has
-- parked replies parks too, so a saga's replies are applied in the order they arrived.
CREATE TABLE IF NOT EXISTS {{schema}}.saga_parked (
    saga_id      text        NOT NULL REFERENCES {{schema}}.saga (id) ON DELETE CASCADE,
    dedup_key    text        NOT NULL,                     -- the reply's (saga_id + step + phase + attempt), claimed when it parked
    seq          bigint      GENERATED ALWAYS AS IDENTITY, -- arrival order, in which a saga's replies are applied
    message_uuid text        NOT NULL,
    metadata     jsonb       NOT NULL,
    payload      bytea       NOT NULL,
    name         text        NOT NULL,                     -- the saga's definition name and version, which the
    version      integer     NOT NULL,                     -- orchestrator that parked the reply lacked
    parked_at    timestamptz NOT NULL DEFAULT now(),
    attempts     integer     NOT NULL DEFAULT 0,           -- failed applications by orchestrators that have the version
    last_error   text,
    PRIMARY KEY (saga_id, dedup_key)
);
-- An orchestrator looks for the parked replies of the versions it has every TimerInterval: by
-- (name, version), in arrival order, so one that lacks the parked versions finds nothing at
-- once however many replies are parked.
CREATE INDEX IF NOT EXISTS saga_parked_version_idx ON {{schema}}.saga_parked (name, version, seq);
