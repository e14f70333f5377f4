-- onceflow 0017: running saga orchestrators and the definition versions they register, so an
-- operator or a CI job sees which versions are still alive (`onceflow saga versions`). The
-- schema placeholder is replaced by the configured, validated and quoted schema name. A new
-- table only: nothing existing changes.

-- One row per running Orchestrator.Run, written when it starts, refreshed every heartbeat
-- (saga.OrchestratorHeartbeat) with the definitions registered at that moment, and deleted
-- when Run returns. A row whose expires_at (database clock) has passed belongs to a process
-- that died without stopping (crash, SIGKILL, a lost network): it no longer counts as live,
-- and the next orchestrator to heartbeat deletes it. A handful of rows: no index beyond the key.
CREATE TABLE IF NOT EXISTS {{schema}}.saga_orchestrator (
    id          text        PRIMARY KEY,                 -- random token drawn when Run starts
    consumer    text        NOT NULL,                    -- OrchestratorConfig.Consumer
    host        text        NOT NULL DEFAULT '',
    pid         integer     NOT NULL DEFAULT 0,
    definitions jsonb       NOT NULL DEFAULT '[]',       -- registered versions: [{"name": "checkout", "version": 2}, ...]
    started_at  timestamptz NOT NULL DEFAULT now(),
    seen_at     timestamptz NOT NULL DEFAULT now(),      -- last heartbeat
    expires_at  timestamptz NOT NULL                     -- seen_at + saga.OrchestratorExpiry
);
