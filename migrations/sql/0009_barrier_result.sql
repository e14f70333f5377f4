-- onceflow 0009: the result of a saga step's action, kept with its barrier row. The schema
-- placeholder is replaced by the configured, validated and quoted schema name. A catalog
-- change only: a nullable column without a default rewrites nothing, and rows that are not a
-- saga action's barrier keep it NULL.

-- The payload of the action's reply (its handler's result, JSON), written in the action's
-- transaction. A compensation reads it, so it can undo what the action did even when the
-- action's reply never reached the saga (the step timed out, then the action committed late):
-- the saga's data then lacks what OnReply would have stored.
ALTER TABLE {{schema}}.processed_event ADD COLUMN IF NOT EXISTS result bytea;
