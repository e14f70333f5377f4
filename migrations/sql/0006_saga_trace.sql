-- onceflow 0006: the trace a saga belongs to. The schema placeholder is replaced by the
-- configured, validated and quoted schema name. A catalog change only (no table rewrite).

-- The W3C trace context (traceparent, tracestate) of the caller of saga.StartTx, so
-- transitions no message carries — a step's timeout or re-send, the deadline, an operator's
-- retry or compensate — are spans in the saga's trace too. '{}' when the start had none.
ALTER TABLE {{schema}}.saga ADD COLUMN IF NOT EXISTS trace jsonb NOT NULL DEFAULT '{}';
