-- onceflow 0003: a claim cursor that stays cheap at any backlog, and wake-ups that do not
-- serialise commits. The schema placeholder is replaced by the configured, validated and
-- quoted schema name. Every statement is a catalog change (no table rewrite); the index
-- build reads the outbox once while holding off writers, which is brief on a drained outbox.

-- The writing transaction's id. The relay claims from a cursor (id > last claimed) instead of
-- from the start of the table, so it never re-reads the rows it already deleted; a row whose
-- transaction commits after later ids were claimed is found through this column: it belongs to
-- a transaction the previous claim's snapshot did not see (in its in-progress list, or started
-- after it), whatever its id. Rows written before this step have NULL: they were committed
-- before the column existed, so no snapshot can still be waiting for them.
ALTER TABLE {{schema}}.outbox ADD COLUMN IF NOT EXISTS tx xid8;
ALTER TABLE {{schema}}.outbox ALTER COLUMN tx SET DEFAULT pg_current_xact_id();
CREATE INDEX IF NOT EXISTS outbox_tx_idx ON {{schema}}.outbox (tx, id);

-- Until when a relay waits for NOTIFY instead of polling tightly ('epoch' = it is polling).
-- Writers notify only while some relay is asleep, so a busy system commits without the
-- cluster-wide lock pg_notify takes at commit. A relay refreshes it with its heartbeat, so a
-- relay that died asleep stops attracting notifications within its lease.
ALTER TABLE {{schema}}.relay_member ADD COLUMN IF NOT EXISTS asleep_until timestamptz NOT NULL DEFAULT 'epoch';

-- Called by outbox writers now and then (see outbox.WakeCheckInterval): sends the wake-up on
-- commit when a relay sleeps, and says whether one does. SECURITY DEFINER so writers need no
-- privilege on relay_member, only EXECUTE (granted to PUBLIC by default).
CREATE OR REPLACE FUNCTION {{schema}}.outbox_wake(channel text) RETURNS boolean
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM {{schema}}.relay_member WHERE asleep_until > now()) THEN
        PERFORM pg_notify(channel, '');
        RETURN true;
    END IF;
    RETURN false;
END
$$;
