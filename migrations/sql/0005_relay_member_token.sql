-- onceflow 0005: one process per relay id. The schema placeholder is replaced by the
-- configured, validated and quoted schema name. A catalog change only (no table rewrite).

-- A random token each relay process draws at start. Two processes started with the same id
-- (ONCEFLOW_RELAY_ID set once for several replicas) would otherwise share one membership and
-- steal each other's shards at every renewal: a relay heartbeats only while the row carries its
-- token, refuses to start while another live process holds the id, and stops when another
-- process took the id over (after this one stopped heartbeating, e.g. paused).
ALTER TABLE {{schema}}.relay_member ADD COLUMN IF NOT EXISTS token text NOT NULL DEFAULT '';
