-- onceflow 0023: vacuum the scheduled messages and the retry lane by a fixed count of dead rows.
-- The schema placeholder is replaced by the configured, validated and quoted schema name.
-- Storage parameters only: no rewrite, a brief SHARE UPDATE EXCLUSIVE lock.
--
-- Both tables are queues read from the front of an index: the relay's move scans
-- outbox_scheduled_due_idx from its start, the lane's drain inbox_parked_due_idx. Every row
-- moved or applied leaves a dead entry there until a VACUUM, and each scan walks them all.
-- PostgreSQL's default waits until dead rows pass 20 % of the live ones: with 1M rows scheduled
-- a day ahead that is 200k moves, and the move's scan was measured at 2.5 ms (1,382 buffers)
-- on that shape, 10.2 ms after a burst of 1M due at once (0.09-0.21 ms once vacuumed), at
-- about 350 scans a second at 1,000 due/s (bench row scheduled_burst, docs/PERFORMANCE.md). A
-- fixed threshold keeps the dead entries to about one autovacuum round's worth, whatever the
-- number of rows waiting.
ALTER TABLE {{schema}}.outbox_scheduled SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000);
ALTER TABLE {{schema}}.inbox_parked SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000);
