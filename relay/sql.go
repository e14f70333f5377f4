package relay

import (
	"github.com/onceflow/onceflow/internal/pgsql"
)

// queries holds the relay's SQL for one schema, built once.
type queries struct {
	outbox, lease, member, parked string

	heartbeat, renew, members, forgetMembers, acquire, release, leave string
	join, holder                                                      string
	shardCount                                                        string
	deleteAcked, countFailure, park                                   string
	sleep, wake                                                       string
	// seqLast reads the outbox id sequence's last value inside a claim (NULL::bigint until
	// prepare found the sequence and may read it).
	seqLast string
}

func newQueries(schema string) *queries {
	q := &queries{
		outbox: pgsql.Table(schema, "outbox"),
		lease:  pgsql.Table(schema, "relay_lease"),
		member: pgsql.Table(schema, "relay_member"),
		parked: pgsql.Table(schema, "outbox_parked"),
	}
	// A sleeping relay's asleep_until follows its heartbeat, so writers stop notifying a relay
	// that died asleep once its membership expires; the heartbeat never sets or clears it (the
	// publishing loop does, and a heartbeat sent just before that must not undo it).
	//
	// The row is this process's only while it carries its token ($5): a heartbeat that updates
	// nothing means another process took the id over (see joinSQL).
	q.heartbeat = `INSERT INTO ` + q.member + ` AS m (id, host, pid, expires_at, token)
		VALUES ($1, $2, $3, now() + make_interval(secs => $4::float8), $5)
		ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), expires_at = EXCLUDED.expires_at, host = EXCLUDED.host, pid = EXCLUDED.pid,
			asleep_until = CASE WHEN m.asleep_until > now() THEN EXCLUDED.expires_at ELSE m.asleep_until END
		WHERE m.token = EXCLUDED.token
		RETURNING 1`
	// join takes the id at start: when free, already this process's, expired, or held by a
	// process whose heartbeat has not moved since $6 (it stopped: crashed, or killed).
	q.join = `INSERT INTO ` + q.member + ` AS m (id, host, pid, expires_at, token)
		VALUES ($1, $2, $3, now() + make_interval(secs => $4::float8), $5)
		ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), started_at = now(), expires_at = EXCLUDED.expires_at,
			host = EXCLUDED.host, pid = EXCLUDED.pid, token = EXCLUDED.token, asleep_until = 'epoch'
		WHERE m.token = EXCLUDED.token OR m.expires_at < now() OR m.heartbeat_at = $6::timestamptz
		RETURNING 1`
	q.holder = `SELECT host, pid, heartbeat_at, now() - heartbeat_at FROM ` + q.member + ` WHERE id = $1`
	q.sleep = `UPDATE ` + q.member + ` SET asleep_until = now() + make_interval(secs => $2::float8) WHERE id = $1`
	q.wake = `UPDATE ` + q.member + ` SET asleep_until = 'epoch' WHERE id = $1 AND asleep_until <> 'epoch'`
	q.seqLast = `NULL::bigint`
	// Renew only what is still ours: same owner and same epoch. A lease that expired but was
	// not taken is still ours (nobody published in between).
	q.renew = `UPDATE ` + q.lease + ` AS l SET expires_at = now() + make_interval(secs => $2::float8)
		FROM unnest($3::int[], $4::bigint[]) AS o(shard, epoch)
		WHERE l.shard = o.shard AND l.epoch = o.epoch AND l.owner = $1
		RETURNING l.shard, l.epoch`
	q.members = `SELECT id FROM ` + q.member + ` WHERE expires_at > now() ORDER BY id`
	// The lease table always holds shards 0..n-1 (prepare and Reshard create it so): its last
	// shard, read from the primary key, gives the count without a scan.
	q.shardCount = `SELECT coalesce(max(shard), -1) + 1 FROM ` + q.lease
	q.forgetMembers = `DELETE FROM ` + q.member + ` WHERE expires_at < now() - interval '1 hour'`
	// Free, expired, or recorded as ours but not held by this process (a restart with the same
	// instance id): the epoch moves on, fencing off whatever held it before. Nothing is taken
	// from a table resharded to another count than this relay's ($5) since it started.
	q.acquire = `UPDATE ` + q.lease + ` AS l
		SET owner = $1, epoch = l.epoch + 1, expires_at = now() + make_interval(secs => $2::float8), acquired_at = now()
		WHERE (` + q.shardCount + `) = $5 AND l.shard IN (
			SELECT shard FROM ` + q.lease + `
			WHERE (owner = '' OR expires_at < now() OR owner = $1) AND shard <> ALL($4::int[])
			ORDER BY (owner = $1) DESC, shard
			LIMIT $3
			FOR UPDATE SKIP LOCKED)
		RETURNING l.shard, l.epoch`
	q.release = `UPDATE ` + q.lease + ` AS l SET owner = '', expires_at = 'epoch'
		FROM unnest($2::int[], $3::bigint[]) AS o(shard, epoch)
		WHERE l.shard = o.shard AND l.epoch = o.epoch AND l.owner = $1`
	q.leave = `DELETE FROM ` + q.member + ` WHERE id = $1 AND token = $2`

	// Acknowledged rows go unconditionally: the broker has them, so deleting them even after
	// the lease was lost can only prevent a duplicate, never lose or reorder anything.
	//
	// Only on the server the rows were claimed from ($2, its pg_postmaster_start_time()): ids
	// are not identities across servers. After a failover to a standby that lacked the old
	// primary's last commits, its id sequence hands out again ids the relay published from the
	// old primary, for other events; deleting by those ids would delete rows never published.
	// A delete sent to another server deletes nothing: the rows, if there, are published again
	// with their event ids (see serverChanged).
	q.deleteAcked = `DELETE FROM ` + q.outbox + ` WHERE id = ANY($1::bigint[]) AND pg_postmaster_start_time() = $2::timestamptz`
	// Attempts and parking change what gets published, so they require the lease (owner and
	// epoch of the row's shard) to still be ours. $4 is the epoch array indexed by shard.
	leaseHeld := `l.shard = o.key_hash % $2 AND l.owner = $3 AND l.epoch = ($4::bigint[])[l.shard + 1]`
	q.countFailure = `UPDATE ` + q.outbox + ` AS o SET attempts = o.attempts + 1, last_error = f.err
		FROM unnest($1::bigint[], $5::text[]) AS f(id, err), ` + q.lease + ` AS l
		WHERE o.id = f.id AND ` + leaseHeld + `
		RETURNING o.id`
	q.park = `WITH moved AS (
			DELETE FROM ` + q.outbox + ` AS o USING unnest($1::bigint[], $5::text[]) AS f(id, err), ` + q.lease + ` AS l
			WHERE o.id = f.id AND ` + leaseHeld + `
			RETURNING o.id, o.event_id, o.topic, o.partition_key, o.key_hash, o.payload, o.metadata, o.created_at, o.attempts + 1 AS attempts, f.err)
		INSERT INTO ` + q.parked + ` (id, event_id, topic, partition_key, key_hash, payload, metadata, created_at, attempts, last_error, parked_by)
		SELECT id, event_id, topic, partition_key, key_hash, payload, metadata, created_at, attempts, err, $3 FROM moved
		RETURNING id`
	return q
}
