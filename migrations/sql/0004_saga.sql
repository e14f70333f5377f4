-- onceflow 0004: orchestrated sagas and their durable timers.
-- The schema placeholder is replaced by the configured, validated and quoted schema name.

-- One row per saga, written by saga.StartTx in the business transaction that starts it and
-- updated under a row lock by every transition (reply, timer, operator request), in the same
-- transaction as the transition's outbox rows and timers.
CREATE TABLE IF NOT EXISTS {{schema}}.saga (
    id          text        PRIMARY KEY,               -- UUIDv7, or the caller's idempotent id
    name        text        NOT NULL,                  -- definition name
    version     integer     NOT NULL,                  -- definition version it runs on to the end
    state       text        NOT NULL,                  -- running, compensating, completed, compensated, stuck
    step        integer     NOT NULL DEFAULT 0,        -- current step index
    attempt     integer     NOT NULL DEFAULT 1,        -- current attempt of the current step's phase
    budget      integer     NOT NULL DEFAULT 0,        -- attempts before the current budget (operator retry)
    waiting     text        NOT NULL DEFAULT '',       -- reply | resend | '' when finished or stuck
    data        jsonb       NOT NULL,                  -- the saga's typed data
    steps       jsonb       NOT NULL,                  -- per-step history: status, attempts, errors, commands sent
    error       text        NOT NULL DEFAULT '',       -- why it compensates or is stuck
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz                            -- set when completed or compensated (retention)
);
CREATE INDEX IF NOT EXISTS saga_state_idx ON {{schema}}.saga (state, name);
CREATE INDEX IF NOT EXISTS saga_finished_at_idx ON {{schema}}.saga (finished_at) WHERE finished_at IS NOT NULL;

-- Durable timers: a step's reply timeout or re-send backoff, the saga deadline, an operator's
-- request. Set and cancelled in the transaction of the transition that decides them; fired by
-- the orchestrator, which claims due rows with FOR UPDATE SKIP LOCKED (with the saga row), so
-- each fires once however many orchestrators run.
CREATE TABLE IF NOT EXISTS {{schema}}.saga_timer (
    saga_id text        NOT NULL REFERENCES {{schema}}.saga (id) ON DELETE CASCADE,
    kind    text        NOT NULL,                      -- step | deadline | operator
    step    integer     NOT NULL DEFAULT 0,
    phase   text        NOT NULL DEFAULT '',
    attempt integer     NOT NULL DEFAULT 0,
    action  text        NOT NULL,                      -- timeout | resend | deadline | retry | compensate
    due_at  timestamptz NOT NULL,
    PRIMARY KEY (saga_id, kind)
);
CREATE INDEX IF NOT EXISTS saga_timer_due_at_idx ON {{schema}}.saga_timer (due_at);
