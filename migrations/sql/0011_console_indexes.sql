-- onceflow 0011: indexes for the saga list's keyset pagination (onceflow saga list, the console).
-- The schema placeholder is replaced by the configured, validated and quoted schema name.

-- Sagas newest first, a page at a time: ORDER BY created_at DESC, id DESC with the cursor
-- (created_at, id) < (last shown). Without them every listing sorted the whole table (1M
-- sagas: a full scan per page). created_at and id never change and state is indexed already
-- (saga_state_idx), so a transition that was a HOT update stays one; each index costs one
-- b-tree insert per started saga.
CREATE INDEX IF NOT EXISTS saga_created_idx ON {{schema}}.saga (created_at, id);
-- The same order within one state (saga list --state stuck, the console's state filter); with
-- name, so `onceflow status` counts the unfinished sagas per definition and state, with the
-- oldest, by an index-only scan of those states alone.
CREATE INDEX IF NOT EXISTS saga_state_created_idx ON {{schema}}.saga (state, created_at, id) INCLUDE (name);
