-- onceflow 0007: late commits found without a second b-tree on the outbox. The schema
-- placeholder is replaced by the configured, validated and quoted schema name.
--
-- Every business commit that writes an event paid for two b-tree insertions: the primary key
-- and outbox_tx_idx (tx, id), which the relay used to find rows committed late below its
-- cursor (measured with 16 writers: the outbox row at 0.63–0.68× a bare transaction, one more
-- plain INSERT at 0.74–0.91×). A BRIN index keeps one summary (the lowest and highest tx) per
-- range of 32 heap pages; inserting into a range that is not summarized yet — the end of the
-- table, where new rows go — costs nothing. The relay summarizes complete ranges itself
-- (outbox_summarize, below), so the unsummarized tail its lookups must read stays short.
--
-- xid8 has no BRIN operator class; its text form is the 64-bit transaction id (epoch and
-- xid), which fits a bigint, and the conversion is immutable.
CREATE INDEX IF NOT EXISTS outbox_tx_brin ON {{schema}}.outbox USING brin (((tx::text)::bigint)) WITH (pages_per_range = 32);
-- Relays of an earlier release look late commits up through this index: upgrade them together
-- with this step (without it their lookup walks the primary key up to their cursor).
DROP INDEX IF EXISTS {{schema}}.outbox_tx_idx;

-- Called by relays now and then (see relay/claim.go): summarizes the outbox's complete page
-- ranges from range from_range on, at most 1024 of them per call (ranges summarized already
-- cost a lookup each), and re-summarizes up to 8 ranges from range sweep on, so a range whose
-- summary was widened by rows written into space vacuum freed narrows again once those rows
-- are gone. Returns the next range to summarize, the number of complete ranges and the next
-- sweep position. SECURITY DEFINER because summarizing requires owning the table; relays need
-- only EXECUTE (granted to PUBLIC by default).
CREATE OR REPLACE FUNCTION {{schema}}.outbox_summarize(from_range bigint, sweep bigint,
        OUT next_range bigint, OUT complete bigint, OUT next_sweep bigint)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    idx constant regclass := '{{schema}}.outbox_tx_brin';
    ppr constant bigint := 32; -- pages_per_range above
    r bigint;
BEGIN
    complete := pg_relation_size('{{schema}}.outbox') / current_setting('block_size')::bigint / ppr;
    next_range := least(greatest(from_range, 0) + 1024, complete);
    FOR r IN greatest(from_range, 0) .. next_range - 1 LOOP
        PERFORM brin_summarize_range(idx, r * ppr);
    END LOOP;
    IF sweep < 0 OR sweep >= complete THEN
        sweep := 0;
    END IF;
    next_sweep := least(sweep + 8, complete);
    FOR r IN sweep .. next_sweep - 1 LOOP
        PERFORM brin_desummarize_range(idx, r * ppr);
        PERFORM brin_summarize_range(idx, r * ppr);
    END LOOP;
END
$$;
