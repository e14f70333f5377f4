package relay

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// A claim reads the next rows to publish without locks, and costs the same whatever the
// backlog, however many rows were deleted before it, and however many rows of other relays'
// shards or of blocked keys lie behind it.
//
// The cursor. Claims do not start at the beginning of the table (which, after a drain, is a
// long run of deleted rows an index scan must step over until vacuum removes them) but after
// cursor.pos: every row of this relay's shards that was visible to the snapshot of the claim
// that set pos (cursor.ref), with an id at or below pos, has been handled (published and
// deleted, parked, or belongs to a blocked chain, which the blockList tracks).
//
// Late commits. Ids are taken when a row is written, not when it commits, so a transaction
// holding id 7 may commit after the claim that published id 8 moved the cursor past it. Such a
// row is invisible to cursor.ref and visible now: its transaction (outbox.tx, the writing
// transaction's id) is in ref's list of transactions in progress, or started after ref (tx at
// or above ref's xmax). The next claim looks those up (nextSQL's late CTE) through a b-tree on
// tx (migration 0012), and when one of them sits at or below the cursor it starts from just
// below it instead. This holds for any writer and any id assignment: it relies only on
// snapshot visibility, never on ids and transaction ids being assigned in the same order.
//
// Why a b-tree (measured, docs/PERFORMANCE.md, "Late commits: b-tree or BRIN"): its lookups
// are two index range scans over the few transactions concerned, whatever the backlog and the
// dead rows, and PostgreSQL keeps it up to date. Migration 0007's BRIN index did not make the
// writers measurably faster (paired per round: b-tree ÷ BRIN 0.99), its lookups read the
// index's whole summary and every page of the ranges overlapping the transactions (29–162 ms
// at 200k–1.2M rows as 0007 ran them, against under 2 ms), and it needed the relay to
// summarize it, which takes SHARE UPDATE EXCLUSIVE on the outbox: any VACUUM, ANALYZE or
// CREATE INDEX CONCURRENTLY stopped delivery, and a summary waiting behind autovacuum
// cancelled it. Nothing on the claim path now takes more than ACCESS SHARE.
//
// Exhaustion. When a claim finds fewer rows than it could take, every visible row above the
// cursor was seen, so the cursor moves to the last id the sequence handed out (rows taken but
// not yet committed are late commits for the next claim). An idle relay on a drained outbox
// therefore reads a few index pages per claim, not the dead rows of the drain.
//
// Resets. The cursor is per relay process. When the relay acquires shards (at start, on
// failover, on rebalance), their rows below the cursor were never looked at, so the cursor goes
// back to 0 and the next claims walk the table once. So it does when a claim finds itself on
// another PostgreSQL server than the last one (a promoted standby, a restart): the cursor's
// ids and snapshot describe the old server's history, which the new one may lack the end of
// (serverChanged).
type cursor struct {
	pos int64
	ref string // pg_snapshot of the claim that set pos, as text; "" when pos is 0
	gen uint64 // lease generation pos belongs to (see leases.gen)
}

// claimKind says which query fetched a batch.
type claimKind int

const (
	claimNext  claimKind = iota // rows after the cursor (and late commits below it)
	claimRetry                  // rows of blocked chains whose backoff expired, up to the cursor
)

// claimed is one claim's outcome.
type claimed struct {
	kind claimKind
	msgs []*Message // in id order
	// taken is how many rows the query selected before the byte budget cut the batch; when it
	// is below the limit and every row was returned, the query saw every candidate (exhausted).
	taken int
	limit int
	low   int64  // claimNext: the id the claim started after (below the cursor after late commits)
	snap  string // claimNext: the claim's snapshot
	seq   *int64 // claimNext: the outbox id sequence's last value, read by the claim
	bytes int64  // payload, key, topic and metadata bytes of msgs
	// server is the start time of the PostgreSQL server the claim ran on
	// (pg_postmaster_start_time()): it changes when a failover or a restart puts the relay
	// on another server, or on the same one after a crash (see serverChanged).
	server time.Time
}

func (c *claimed) exhausted() bool { return c.taken < c.limit && len(c.msgs) == c.taken }

// rowColumns are the columns a claim returns per row, and rowSize the bytes one counts toward
// Config.MaxBatchBytes (payload and metadata sizes are read without detoasting).
const (
	rowColumns = `id, event_id, topic, partition_key, key_hash, payload, metadata, created_at, attempts`
	rowSize    = `octet_length(payload) + octet_length(topic) + octet_length(partition_key) + pg_column_size(metadata) + 64`
)

// claimArgs collects positional parameters.
type claimArgs struct{ args []any }

func (a *claimArgs) add(v any) string {
	a.args = append(a.args, v)
	return "$" + strconv.Itoa(len(a.args))
}

// shardFilter is the condition restricting rows to the snapshot's shards ("" when it owns all).
func (a *claimArgs) shardFilter(s snapshot, shards int) string {
	if s.all {
		return ""
	}
	return ` AND key_hash % ` + a.add(shards) + ` = ANY(` + a.add(s.shards) + `::int[])`
}

// budgeted wraps a CTE named batch (rows in id order with a size column) into the final
// select: a header row (head = true) carrying the claim's bookkeeping and the server's start
// time (its row columns are placeholders, so every row scans into the same targets), then the
// rows that fit the byte budget (the first row always does).
func budgeted(header string, budget string) string {
	return `, sized AS (SELECT *, sum(size) OVER (ORDER BY id) AS run, row_number() OVER (ORDER BY id) AS rn FROM batch)
	SELECT true AS head, ` + header + `, (SELECT count(*) FROM batch), pg_postmaster_start_time(),
		0::bigint, '', '', '', 0::bigint, ''::bytea, '{}'::jsonb, 'epoch'::timestamptz, 0, 0::bigint
	UNION ALL
	SELECT false, NULL, NULL, NULL, NULL, NULL, id, event_id::text, topic, partition_key, key_hash, payload, metadata, created_at, attempts, size
	FROM sized WHERE run <= ` + budget + ` OR rn = 1`
}

// nextSQL builds the cursor claim: committed rows of the snapshot's shards above the cursor
// (or above the lowest late commit below it), minus blocked chains, in id order, at most
// limit rows and about budget bytes.
//
// late: rows at or below the cursor whose transaction the reference snapshot did not see,
// found through the b-tree on tx (outbox_tx_idx, migration 0012): the transactions that
// started after it (a range bounded by the current snapshot, which cannot see later ones
// anyway: a few recent transactions), and those it listed as in progress (one probe each).
// Both are index range scans whose cost depends on how many rows those transactions wrote,
// not on the backlog, on dead rows or on any summary, and they take no lock but the
// ACCESS SHARE every read takes: nothing an operator's VACUUM, ANALYZE or CREATE INDEX
// CONCURRENTLY holds makes the claim wait. OFFSET 0 keeps the planner from turning min(id)
// into a walk of the primary key; `id + 0` keeps it from reading the primary key up to the
// cursor instead of the tx index (a generic plan cannot see how few rows the tx range holds).
func (q *queries) nextSQL(s snapshot, shards int, c cursor, b blockedSet, limit int, budget int64) (string, []any) {
	a := &claimArgs{}
	pos := a.add(c.pos)
	// NULL without a reference snapshot yet: no late commits to look for.
	var xmax, xip any
	if c.ref != "" {
		xmax, xip = splitSnapshot(c.ref)
	}
	xmaxArg, xipArg := a.add(xmax), a.add(xip)
	shard := a.shardFilter(s, shards)
	var sb strings.Builder
	sb.WriteString(`WITH late AS (
		SELECT id FROM ` + q.outbox + `
		WHERE tx >= ` + xmaxArg + `::text::xid8 AND tx < pg_snapshot_xmax(pg_current_snapshot()) AND id + 0 <= ` + pos + shard + `
		UNION ALL
		SELECT id FROM ` + q.outbox + ` WHERE tx = ANY(` + xipArg + `::text[]::xid8[]) AND id + 0 <= ` + pos + shard + `
		OFFSET 0),
	low AS (SELECT LEAST(` + pos + `::bigint, (SELECT min(id) - 1 FROM late)) AS lo),
	batch AS (
		SELECT ` + rowColumns + `, ` + rowSize + ` AS size FROM ` + q.outbox + `
		WHERE id > (SELECT lo FROM low)` + shard)
	if len(b.keys) > 0 {
		sb.WriteString(` AND partition_key <> ALL(` + a.add(b.keys) + `::text[])`)
	}
	if len(b.ids) > 0 {
		sb.WriteString(` AND id <> ALL(` + a.add(b.ids) + `::bigint[])`)
	}
	sb.WriteString(` ORDER BY id LIMIT ` + a.add(limit) + `)`)
	sb.WriteString(budgeted(`(SELECT lo FROM low), pg_current_snapshot()::text, `+q.seqLast, a.add(budget)))
	return sb.String(), a.args
}

// splitSnapshot returns the xmax and the in-progress list of a pg_snapshot in its text form
// (xmin:xmax:xip,xip,...).
func splitSnapshot(snap string) (xmax string, xip []string) {
	parts := strings.SplitN(snap, ":", 3)
	if len(parts) != 3 {
		return "0", nil // not a snapshot: every transaction counts as started after it
	}
	xip = []string{}
	if parts[2] != "" {
		xip = strings.Split(parts[2], ",")
	}
	return parts[1], xip
}

// snapshotXmax returns a pg_snapshot's xmax (the first transaction id it counts as not yet
// started), ok=false if snap is not a snapshot.
func snapshotXmax(snap string) (xmax uint64, ok bool) {
	x, _ := splitSnapshot(snap)
	v, err := strconv.ParseUint(x, 10, 64)
	return v, err == nil && snap != ""
}

// retrySQL builds the retry claim: rows of the due chains from their lowest floor up to the
// cursor, in id order (their rows above the cursor come through cursor claims once they are
// no longer blocked).
func (q *queries) retrySQL(s snapshot, shards int, c cursor, b blockedSet, limit int, budget int64) (string, []any) {
	a := &claimArgs{}
	var sb strings.Builder
	sb.WriteString(`WITH batch AS (SELECT ` + rowColumns + `, ` + rowSize + ` AS size FROM ` + q.outbox + `
		WHERE id >= ` + a.add(b.floor) + ` AND id <= ` + a.add(c.pos) + a.shardFilter(s, shards))
	var or []string
	if len(b.dueKeys) > 0 {
		or = append(or, `partition_key = ANY(`+a.add(b.dueKeys)+`::text[])`)
	}
	if len(b.dueIDs) > 0 {
		or = append(or, `id = ANY(`+a.add(b.dueIDs)+`::bigint[])`)
	}
	sb.WriteString(` AND (` + strings.Join(or, " OR ") + `) ORDER BY id LIMIT ` + a.add(limit) + `)`)
	sb.WriteString(budgeted(`NULL::bigint, NULL::text, NULL::bigint`, a.add(budget)))
	return sb.String(), a.args
}

// planSettings pins the claim's plan to index scans. The claim's bounds come from parameters
// and from its own CTEs, so a generic plan (which pgx's prepared statements get after five
// executions) cannot know that it reads a few rows past the cursor: planned while the outbox
// was small, it may scan and sort the whole table, and keep doing so, dead rows included, as
// the backlog grows. An ordered index walk is right at every size. No parallel plan either:
// starting workers costs milliseconds (measured: 0007's late-commit lookup, planned generic,
// ran as a parallel bitmap heap scan at about 20 ms, for 110 buffers), and a claim reads a
// batch.
const planSettings = `SELECT set_config('enable_seqscan', 'off', true), set_config('enable_bitmapscan', 'off', true),
	set_config('max_parallel_workers_per_gather', '0', true)`

// asyncCommit makes the transaction's commit not wait for the WAL flush, for transactions
// that delete acknowledged rows (see deleteAcked for why that is safe).
const asyncCommit = `set_config('synchronous_commit', 'off', true)`

// roundTripSettings is what a claim's round trip sets for its own transaction: planSettings,
// and asyncCommit (it may carry a delete).
const roundTripSettings = planSettings + `, ` + asyncCommit

// runClaim executes a claim query and decodes its header and rows, in one round trip of three
// statements: roundTripSettings, the delete of the last batch's acknowledged rows (del, see
// pendingDelete) when there are any, and the claim. A pgx batch ends with a single Sync, so
// they run as one implicit transaction: the settings last until its end and no longer (the
// pool's connection is left as it was), and the claim's snapshot, taken after the delete in
// the same transaction, does not see the deleted rows, as if the delete had committed before
// it. (Each in a transaction of its own, BEGIN and COMMIT included, took eight statements.)
// deleted reports whether the transaction, and so the delete, committed.
func (r *Relay) runClaim(ctx context.Context, kind claimKind, sql string, args []any, limit int, del pendingDelete) (c *claimed, deleted bool, err error) {
	b := &pgx.Batch{}
	b.Queue(roundTripSettings)
	if len(del.ids) > 0 {
		b.Queue(r.q.deleteAcked, del.ids, del.server)
	}
	b.Queue(sql, args...)
	br := r.pool.SendBatch(ctx, b)
	defer func() { _ = br.Close() }()
	for range b.Len() - 1 {
		if _, err := br.Exec(); err != nil {
			return nil, false, err
		}
	}
	if c, err = scanClaim(br, kind, limit); err != nil {
		return nil, false, err
	}
	if err := br.Close(); err != nil {
		return nil, false, err // the implicit transaction did not commit: nor did the delete
	}
	return c, len(del.ids) > 0, nil
}

func scanClaim(br pgx.BatchResults, kind claimKind, limit int) (*claimed, error) {
	rows, err := br.Query()
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	// A busy relay claims a few rows thousands of times a second: a batch-sized slice up front
	// was the largest share of its garbage (GC cycles show in its latency tail); append grows it.
	c := &claimed{kind: kind, limit: limit, msgs: make([]*Message, 0, min(limit, 16))}
	sawHeader := false
	// Scan targets are reused across rows, as values: per-row variables whose addresses go to
	// Scan, and pointers for the NULL-able header columns, cost eight allocations per row.
	var (
		head                      bool
		low, seq, taken, id, size pgtype.Int8
		snap                      pgtype.Text
		server                    pgtype.Timestamptz
		meta                      []byte
	)
	for rows.Next() {
		m := &Message{}
		if err := rows.Scan(&head, &low, &snap, &seq, &taken, &server,
			&id, &m.EventID, &m.Topic, &m.Key, &m.keyHash, &m.Payload, &meta, &m.CreatedAt, &m.Attempts, &size); err != nil {
			return nil, err
		}
		if head {
			sawHeader = true
			if low.Valid {
				c.low = low.Int64
			}
			if snap.Valid {
				c.snap = snap.String
			}
			if seq.Valid {
				v := seq.Int64
				c.seq = &v
			}
			if taken.Valid {
				c.taken = int(taken.Int64)
			}
			if server.Valid {
				c.server = server.Time
			}
			continue
		}
		m.ID = id.Int64
		m.blockKey = blockKeyOf(m.Key, m.ID)
		if m.Metadata, err = parseMetadata(meta); err != nil {
			// Not a JSON object of strings (the writer never stores that): refuse this row only.
			m.Metadata = nil
			m.badMetadata = fmt.Errorf("metadata of row %d is not a JSON object of strings: %w", m.ID, err)
		}
		if size.Valid {
			c.bytes += size.Int64
		}
		c.msgs = append(c.msgs, m)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if !sawHeader {
		return nil, fmt.Errorf("claim returned no header row")
	}
	// UNION ALL keeps the order of its branches and the window's, but nothing promises it.
	slices.SortFunc(c.msgs, func(a, b *Message) int { return compareInt64(a.ID, b.ID) })
	return c, nil
}

func compareInt64(a, b int64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
