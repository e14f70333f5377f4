// Package relay publishes the transactional outbox to a broker: it claims committed rows in
// id order, publishes them through a Sink (to Kafka through an idempotent producer with
// relay/relaykafka, or to any Watermill publisher with NewPublisherSink), and deletes exactly
// the rows the broker acknowledged. A crash anywhere in
// between leaves the rows in place, so they are published again with the same event id:
// delivery is at-least-once, identity is stable, and consumers deduplicate with the inbox.
//
//	sink, _ := relaykafka.NewSink(relaykafka.Config{Brokers: []string{"localhost:9092"}})
//	r, _ := relay.New(relay.Config{Pool: pool, Sink: sink})
//	err := r.Run(ctx) // until ctx is cancelled
//
// # Wake-up
//
// While rows keep arriving the relay claims every Config.BusyPollInterval (1ms), and a full
// batch is followed at once by the next claim, which is sent while the batch is published and
// used only if that batch ended well (every row acknowledged). After 25ms without rows it marks itself asleep
// in relay_member; outbox writers then send a NOTIFY on commit, which wakes it through a LISTEN
// on a dedicated connection, and its polls back off to Config.PollInterval (1s). Writers do not
// notify while relays are awake: NOTIFY takes a cluster-wide lock at commit, and sending one in
// every business transaction would serialise them (docs/relay.md, "Wake-up and cost").
//
// # Claims
//
// A claim is a plain SELECT of committed rows, from a per-relay cursor, so its cost does not
// grow with the backlog, the rows deleted before it, or other relays' rows; a row whose
// transaction commits after later ids were claimed is found through the writing transaction's
// id (outbox.tx) and the previous claim's snapshot, and claimed next. An unrelated open
// transaction never delays a claim. Config.MaxBatchBytes bounds a batch's bytes, and so the
// relay's memory.
//
// # Per-key order and several relays
//
// Rows are spread over Config.Shards virtual shards by their key hash (rows without a key by
// their event id). Each shard is leased to one relay at a time in the relay_lease table; relays
// heartbeat in relay_member and each takes a fair share, so shards rebalance when relays start,
// stop or die (failover at most Config.FailoverBound, 10s by default). A relay stops publishing
// a shard before its lease can expire in the database (fencing), and attempts and parking
// require the lease's epoch to be unchanged.
//
// Order precondition: the relay publishes a key's rows in id order, and ids follow commit
// order only for writes the application serialises. Write the events of one key from
// transactions that are serialised per key (e.g. by locking the aggregate row with SELECT ...
// FOR UPDATE, or by updating it), then the consumer sees the key's events in commit order.
// Duplicates (after a crash between publish and delete) repeat an earlier event with the same
// id; the first occurrences are always in order.
//
// # Failures
//
// Transient broker errors leave the rows in place and retry with capped exponential backoff
// and jitter, for as long as it takes; they never park anything. A row the broker refuses
// every time (undeliverable: too large, invalid record) blocks only its own key: later rows of that key wait,
// other keys flow. After Config.MaxAttempts such refusals (counted in outbox.attempts) the row
// is parked in outbox_parked with its error, and the key moves on without it, which breaks
// that key's order by design. Admin.ReplayTx (onceflow outbox replay) moves parked rows back
// with their original event id.
package relay
