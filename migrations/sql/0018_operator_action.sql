-- onceflow 0018: the operator's audit trail. Every operator action — a saga retry, compensation
-- or upgrade request, an outbox replay, an inbox poison replay or deletion, from the console,
-- the CLI or a service's own call of the Admin APIs — writes one row here in the transaction of
-- the action itself: an action that rolled back leaves none, one that committed always has one.
-- The schema placeholder is replaced by the configured, validated and quoted schema name. A new
-- table only: nothing existing changes. Its rows are few (operators' clicks) and kept: no
-- cleaner removes them.
CREATE TABLE IF NOT EXISTS {{schema}}.operator_action (
    id      bigserial   PRIMARY KEY,
    at      timestamptz NOT NULL DEFAULT now(),
    actor   text        NOT NULL,                  -- the credential's name, "cli:<os user>", or "service"
    action  text        NOT NULL,                  -- "saga retry", "outbox replay", ...
    targets text[]      NOT NULL DEFAULT '{}',     -- saga ids, event ids or poison row ids acted on
    filter  text        NOT NULL DEFAULT '',       -- the filter the targets were selected by, if any
    outcome text        NOT NULL DEFAULT ''        -- what was done, e.g. "requested", "replays requested: 3"
);
-- The actions on one saga, event or poison row (its page shows them).
CREATE INDEX IF NOT EXISTS operator_action_targets_idx ON {{schema}}.operator_action USING gin (targets);
