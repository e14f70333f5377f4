-- onceflow 0020: the open poison rows counted without reading the history. The schema
-- placeholder is replaced by the configured, validated and quoted schema name.
--
-- `onceflow status` and the console's overview count, per consumer, the rows given up
-- (state 'poison') and the replay requests waiting (inbox.Admin.PoisonSummary). Replayed rows
-- stay as history until an operator deletes them, so the table can hold far more of them than
-- open rows; without this index the count read every one of them. The partial index holds the
-- open rows only, with the columns the count reads (an index-only scan).
CREATE INDEX IF NOT EXISTS inbox_poison_open_idx ON {{schema}}.inbox_poison (consumer, state, replay_requested_at)
    WHERE state IN ('poison', 'replay_requested');
