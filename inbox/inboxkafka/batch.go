package inboxkafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/config"
	"github.com/onceflow/onceflow/internal/engine"
	"github.com/onceflow/onceflow/internal/failure"
	"github.com/onceflow/onceflow/internal/kafkarecord"
	"github.com/onceflow/onceflow/migrations"
)

// BatchConsumer defaults.
const (
	// DefaultMaxBatch bounds the messages of one partition applied in one transaction.
	DefaultMaxBatch = 256
	// DefaultWorkers is how many partitions are processed at once.
	DefaultWorkers = 4
	// DefaultMaxAttempts is how often a failing message is tried before it is given up as
	// poison: the retry default of every onceflow consumer.
	DefaultMaxAttempts = engine.DefaultMaxAttempts
	// DefaultBackoff is the wait before a failing message's second attempt; it doubles per
	// attempt up to DefaultMaxBackoff.
	DefaultBackoff = engine.DefaultBackoff
	// DefaultMaxBackoff caps the wait between attempts, also between retries of a batch the
	// database refused as a whole.
	DefaultMaxBackoff = engine.DefaultMaxBackoff
)

// BatchConfig configures a BatchConsumer. Brokers, Group, Topics and Processor are required.
type BatchConfig struct {
	// Brokers are the Kafka bootstrap addresses (host:port). Required.
	Brokers []string
	// Group is the consumer group; its committed offsets are where a restart resumes.
	// Required. Use one group per processor (per handler), as with the router.
	Group string
	// Topics are consumed by Processor. Required.
	Topics []string
	// Processor applies the batches: inbox.Inbox.Batch, BatchNoPublish or BatchFunc, or a
	// saga orchestrator or participant. Required.
	Processor inbox.BatchProcessor
	// MaxBatch bounds the messages of one partition in one transaction. Default
	// DefaultMaxBatch. There is no linger: a batch is what one poll returned (up to
	// MaxBatch), so a lone message goes at once and batches grow only under load.
	MaxBatch int
	// Workers is how many partitions apply a batch at once, each in its own transaction (so
	// each holds a connection of the processor's pool: size the pool for Workers + 1).
	// Default DefaultWorkers.
	Workers int
	// MaxAttempts is how often a message whose handler fails is tried before it is given up
	// (Processor.SettlePoison). Default DefaultMaxAttempts; 1 gives up at the first failure.
	// Messages that no retry can fix (inbox.IsPoison: no dedup key, an invalid outgoing
	// message) are given up at once.
	MaxAttempts int
	// Backoff is the wait before a failing message's second attempt, doubled per attempt up
	// to MaxBackoff. Defaults DefaultBackoff and DefaultMaxBackoff. While a message waits,
	// later messages of its partition wait too (they never overtake it); other partitions
	// go on.
	Backoff, MaxBackoff time.Duration
	// Logger receives given-up messages and batches the database refused. Default
	// slog.Default().
	Logger *slog.Logger
	// ClientOpts are extra franz-go options (TLS, SASL, client id, session timeouts), applied
	// after the consumer's own.
	ClientOpts []kgo.Opt
}

// BatchConsumer consumes topics with franz-go's consumer group client and applies each
// partition's messages in batches through a BatchProcessor: process, then commit.
//
//   - Order: a partition's messages are applied in offset order; partitions run in parallel
//     (up to Workers).
//   - Batches: what one poll returned for a partition, up to MaxBatch per transaction. No
//     linger: a lone message is applied at once.
//   - Offsets: a message's offset is marked for commit only after its transaction committed
//     (or it was given up); marked offsets are committed every second, when partitions are
//     revoked and when Run returns. A crash redelivers what was applied since the last
//     commit, and the inbox skips it as duplicates.
//   - Each assigned partition has a goroutine of its own, fed by one poll loop: a partition
//     whose message is retried or whose batch is slow holds up no other partition. A
//     partition with more than 8 × MaxBatch records waiting is paused until its worker
//     caught up, which bounds memory.
//   - Rebalances wait for the batches in flight: a revoked partition's worker is stopped (a
//     batch in flight commits or rolls back, a retry's wait ends), then its offsets are
//     committed, and only then does franz-go hand the partition over.
//   - Failure isolation: when a message's handler fails, the batch rolls back; the messages
//     before it are applied again as a batch, and the failing one alone, with retries and
//     backoff; after MaxAttempts it is given up as poison (recorded with its dedup row in one
//     transaction) and its partition moves on. A set-based handler that does not say which
//     message failed is split in halves down to the failing message. No savepoints: more than
//     64 subtransactions in one transaction slow every snapshot of the server.
//   - A batch the database refuses as a whole (connection lost, server restarting) is retried
//     with backoff, without counting attempts, until it succeeds or Run's context ends.
type BatchConsumer struct {
	cfg   BatchConfig
	cl    *kgo.Client
	log   *slog.Logger
	slots chan struct{} // Workers: transactions applied at once
	proc  slotted       // cfg.Processor, each call holding a slot
	// hot serialises the consumer's transactions for hotFor after a conflict between two of
	// them (hotUntil, unix nanoseconds): see slotted.
	hot      sync.Mutex
	hotUntil atomic.Int64

	mu      sync.Mutex
	runCtx  context.Context // Run's; workers started by assignments derive from it
	workers map[partition]*worker

	closeOnce sync.Once
}

type partition struct {
	topic string
	id    int32
}

// worker applies one partition's records in order. The poll loop appends to queue; the
// worker takes up to MaxBatch at a time, so batches grow while a batch is in flight.
type worker struct {
	p      partition
	mu     sync.Mutex
	queue  []*kgo.Record
	paused bool
	wake   chan struct{} // 1-buffered: records were queued
	cancel context.CancelFunc
	done   chan struct{}
}

// NewBatchConsumer validates cfg, reporting every problem at once, and connects the client
// (it joins the group when Run starts polling).
func NewBatchConsumer(cfg BatchConfig) (*BatchConsumer, error) {
	if cfg.MaxBatch == 0 {
		cfg.MaxBatch = DefaultMaxBatch
	}
	if cfg.Workers == 0 {
		cfg.Workers = DefaultWorkers
	}
	if cfg.MaxAttempts == 0 {
		cfg.MaxAttempts = DefaultMaxAttempts
	}
	if cfg.Backoff == 0 {
		cfg.Backoff = DefaultBackoff
	}
	if cfg.MaxBackoff == 0 {
		cfg.MaxBackoff = DefaultMaxBackoff
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	var problems []error
	if len(cfg.Brokers) == 0 {
		problems = append(problems, errors.New("Brokers is empty: pass the Kafka bootstrap addresses (host:port)"))
	}
	if cfg.Group == "" {
		problems = append(problems, errors.New("Group is empty: a batched consumer needs a consumer group, or no offsets are committed and every restart re-reads the topics"))
	}
	if len(cfg.Topics) == 0 {
		problems = append(problems, errors.New("Topics is empty: name the topics to consume"))
	}
	if cfg.Processor == nil {
		problems = append(problems, errors.New("Processor is nil: pass ib.Batch(...), ib.BatchNoPublish(...), ib.BatchFunc(...) or a saga orchestrator or participant"))
	}
	if cfg.MaxBatch < 1 || cfg.MaxBatch > 10000 {
		problems = append(problems, fmt.Errorf("MaxBatch is %d; use 0 for the default (%d) or 1..10000", cfg.MaxBatch, DefaultMaxBatch))
	}
	if cfg.Workers < 1 {
		problems = append(problems, fmt.Errorf("Workers is %d; use 0 for the default (%d) or a positive number", cfg.Workers, DefaultWorkers))
	}
	if cfg.MaxAttempts < 1 {
		problems = append(problems, fmt.Errorf("MaxAttempts is %d; use 0 for the default (%d) or a positive number", cfg.MaxAttempts, DefaultMaxAttempts))
	}
	if cfg.Backoff < 0 || cfg.MaxBackoff < cfg.Backoff {
		problems = append(problems, fmt.Errorf("Backoff %s and MaxBackoff %s: use 0 for the defaults, or 0 < Backoff <= MaxBackoff", cfg.Backoff, cfg.MaxBackoff))
	}
	if err := config.Check("inboxkafka batch consumer", problems...); err != nil {
		return nil, err
	}
	opts := []kgo.Opt{
		kgo.SeedBrokers(cfg.Brokers...),
		kgo.ConsumerGroup(cfg.Group),
		kgo.ConsumeTopics(cfg.Topics...),
		// A new group starts at the oldest retained message, not after what was published
		// before it joined (see the package documentation).
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		// A paused partition that is resumed joins the next fetch, after the one in flight:
		// bound that wait (franz-go's default is 5 s; sarama's 500 ms).
		kgo.FetchMaxWait(500 * time.Millisecond),
		// A rebalance waits while a poll's records are being handed to the workers (only that:
		// Run allows it again right after), so records polled before a partition was revoked
		// never reach a worker started by a later assignment of it, ahead of what that
		// assignment fetches from the committed offset.
		kgo.BlockRebalanceOnPoll(),
		// Only offsets marked after their transaction committed are committed.
		kgo.AutoCommitMarks(),
		kgo.AutoCommitInterval(AutoCommitInterval),
		kgo.ClientID("onceflow-inbox-batch"),
	}
	c := &BatchConsumer{cfg: cfg, log: cfg.Logger.With("group", cfg.Group), slots: make(chan struct{}, cfg.Workers),
		workers: map[partition]*worker{}}
	c.proc = slotted{c}
	opts = append(opts,
		kgo.OnPartitionsAssigned(func(_ context.Context, _ *kgo.Client, assigned map[string][]int32) { c.assign(assigned) }),
		// franz-go waits for these before it hands the partitions over (or rejoins).
		kgo.OnPartitionsRevoked(func(ctx context.Context, cl *kgo.Client, revoked map[string][]int32) {
			c.stop(revoked)
			c.commitMarked(ctx, cl)
		}),
		kgo.OnPartitionsLost(func(_ context.Context, _ *kgo.Client, lost map[string][]int32) {
			c.stop(lost) // no commit: the partitions belong to another member already
		}))
	opts = append(opts, cfg.ClientOpts...)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, fmt.Errorf("inboxkafka: batch consumer: %w", err)
	}
	c.cl = cl
	return c, nil
}

// Client returns the franz-go client, e.g. for metrics hooks or lag checks.
func (c *BatchConsumer) Client() *kgo.Client { return c.cl }

func (c *BatchConsumer) commitMarked(ctx context.Context, cl *kgo.Client) {
	if err := cl.CommitMarkedOffsets(ctx); err != nil && !errors.Is(err, context.Canceled) {
		c.log.Warn("inboxkafka: committing offsets failed; the messages since the last commit will be redelivered and skipped as duplicates", "err", err)
	}
}

// Run consumes until ctx ends, then lets the batches in flight finish, commits the offsets of
// what was applied, leaves the group and returns nil. While it runs, a processor that is an
// replayer (ib.Batch, BatchNoPublish, BatchFunc) also applies the replay requests of the poison
// rows this consumer's topics gave up (not those of a router or of another batched consumer
// that shares the inbox's Consumer name), every inbox.Config.ReplayInterval, with MaxAttempts
// and Backoff. It returns an error only if the client
// stopped for another reason, or at once when the processor's schema is not migrated (a
// processor with a CheckSchema method: the inbox's, the saga orchestrator and participants;
// the error matches migrations.ErrNotMigrated and names the command to run). Call it once.
func (c *BatchConsumer) Run(ctx context.Context) error {
	if err := c.waitForSchema(ctx); err != nil {
		c.Close()
		return err
	}
	if ctx.Err() != nil {
		c.Close()
		return nil
	}
	c.mu.Lock()
	c.runCtx = ctx
	c.mu.Unlock()
	defer c.Close()
	if r, ok := c.cfg.Processor.(engine.Replayer); ok {
		// Replay requests of the processor's poison rows (`onceflow inbox poison replay`):
		// applied by this group's own processes, so no other group sees the messages again.
		// Stopped (its transaction finished) before Close leaves the group.
		rctx, cancel := context.WithCancel(ctx)
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			engine.RunReplays(rctx, r.ReplayInterval(), c.log, func(ctx context.Context) (int, error) {
				return r.ApplyReplays(ctx, c.policy(), c.cfg.Topics)
			})
		}()
		defer func() {
			cancel()
			wg.Wait()
		}()
	}
	if d, ok := c.cfg.Processor.(engine.LaneDrainer); ok {
		// The retry lane (inbox.RetryAfter): parked messages of this consumer's topics are
		// applied by its own processes when due, each key's in order.
		lctx, cancel := context.WithCancel(ctx)
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			engine.RunEvery(lctx, "draining the retry lane", d.LaneInterval(), c.log, func(ctx context.Context) (int, error) {
				return d.DrainLanes(ctx, c.policy(), c.cfg.Topics)
			})
		}()
		defer func() {
			cancel()
			wg.Wait()
		}()
	}
	for {
		fetches := c.cl.PollFetches(ctx)
		if fetches.IsClientClosed() {
			c.cl.AllowRebalance()
			if ctx.Err() != nil {
				return nil
			}
			return errors.New("inboxkafka: batch consumer: the client was closed")
		}
		if ctx.Err() != nil {
			c.cl.AllowRebalance()
			return nil
		}
		fetches.EachError(func(topic string, p int32, err error) {
			if !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
				c.log.Warn("inboxkafka: fetch error", "topic", topic, "partition", p, "err", err)
			}
		})
		fetches.EachPartition(func(p kgo.FetchTopicPartition) {
			if len(p.Records) > 0 {
				c.dispatch(partition{p.Topic, p.Partition}, p.Records)
			}
		})
		c.cl.AllowRebalance()
	}
}

// waitForSchema checks the processor's schema before the consumer joins its group (a processor
// with a CheckSchema method: the inbox's, the saga orchestrator and participants). An
// unmigrated schema is fatal: no retry can fix it, so Run says which command to run. Any other
// failure (PostgreSQL down or restarting) is waited out with backoff, one log line a round,
// until the check passes or ctx ends (nil).
func (c *BatchConsumer) waitForSchema(ctx context.Context) error {
	sc, ok := c.cfg.Processor.(interface{ CheckSchema(context.Context) error })
	if !ok {
		return nil
	}
	for round := 1; ; round++ {
		err := sc.CheckSchema(ctx)
		switch {
		case err == nil:
			if round > 1 {
				c.log.Info("inboxkafka: the database answers; starting", "rounds", round)
			}
			return nil
		case ctx.Err() != nil:
			return nil
		case errors.Is(err, migrations.ErrNotMigrated):
			return fmt.Errorf("inboxkafka: batch consumer of group %q: %w", c.cfg.Group, err)
		}
		wait := failure.Backoff(c.cfg.Backoff, c.cfg.MaxBackoff, round)
		c.log.Error("inboxkafka: cannot check the database schema; waiting for the database before starting", "err", err, "retry_in", wait, "round", round)
		if !failure.Sleep(ctx, wait) {
			return nil
		}
	}
}

// assign starts a worker for each newly assigned partition.
func (c *BatchConsumer) assign(assigned map[string][]int32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	parent := c.runCtx
	if parent == nil {
		parent = context.Background()
	}
	for topic, ps := range assigned {
		for _, id := range ps {
			p := partition{topic, id}
			if c.workers[p] != nil {
				continue
			}
			ctx, cancel := context.WithCancel(parent)
			w := &worker{p: p, wake: make(chan struct{}, 1), cancel: cancel, done: make(chan struct{})}
			c.workers[p] = w
			go c.work(ctx, w)
		}
	}
}

// stop stops the workers of the given partitions (all when nil) and waits for them: a batch
// in flight commits or rolls back, a retry's wait ends. Records they had not taken are
// dropped; the partition's next owner reads them again from the committed offset.
func (c *BatchConsumer) stop(parts map[string][]int32) {
	c.mu.Lock()
	var stopped []*worker
	for p, w := range c.workers {
		if parts == nil || slices.Contains(parts[p.topic], p.id) {
			w.cancel()
			stopped = append(stopped, w)
			delete(c.workers, p)
		}
	}
	c.mu.Unlock()
	for _, w := range stopped {
		<-w.done
		w.mu.Lock()
		if w.paused { // a later assignment of the partition must fetch it
			w.paused = false
			c.cl.ResumeFetchPartitions(map[string][]int32{w.p.topic: {w.p.id}})
		}
		w.mu.Unlock()
	}
}

// dispatch queues a partition's polled records for its worker, pausing the partition while
// its worker is far behind.
func (c *BatchConsumer) dispatch(p partition, recs []*kgo.Record) {
	c.mu.Lock()
	w := c.workers[p]
	c.mu.Unlock()
	if w == nil {
		return // revoked meanwhile: the next owner reads them from the committed offset
	}
	// Paused and resumed under the worker's lock, so a resume decided by the worker can never
	// be overtaken by an earlier pause (which would leave the partition paused with an empty
	// queue), nor a pause by an earlier resume (which would void the memory bound).
	w.mu.Lock()
	w.queue = append(w.queue, recs...)
	if !w.paused && len(w.queue) > c.pauseAbove() {
		w.paused = true
		c.cl.PauseFetchPartitions(map[string][]int32{p.topic: {p.id}})
	}
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// pauseAbove is how many records may wait for a worker before its partition is paused.
func (c *BatchConsumer) pauseAbove() int { return max(8*c.cfg.MaxBatch, 4096) }

// work applies a partition's queued records, up to MaxBatch at a time, until ctx ends.
func (c *BatchConsumer) work(ctx context.Context, w *worker) {
	defer close(w.done)
	for {
		w.mu.Lock()
		n := min(len(w.queue), c.cfg.MaxBatch)
		recs := w.queue[:n:n]
		w.queue = w.queue[n:]
		if w.paused && len(w.queue) <= c.pauseAbove()/4 {
			w.paused = false
			c.cl.ResumeFetchPartitions(map[string][]int32{w.p.topic: {w.p.id}})
		}
		w.mu.Unlock()
		if n == 0 {
			select {
			case <-ctx.Done():
				return
			case <-w.wake:
				continue
			}
		}
		if !c.settle(ctx, recs) {
			return // ctx ended: the rest is redelivered to the partition's next owner
		}
	}
}

// settle applies one partition's records in order, in batches of at most MaxBatch, and marks
// each batch's offsets once it is settled. It stops early only when ctx ends (false).
func (c *BatchConsumer) settle(ctx context.Context, recs []*kgo.Record) bool {
	msgs := make([]*message.Message, len(recs))
	for i, r := range recs {
		msgs[i] = kafkarecord.Decode(inbox.WithOrigin(ctx, source(r), string(r.Key)), r)
	}
	for done := 0; done < len(recs); {
		n := min(c.cfg.MaxBatch, len(recs)-done)
		k, failed := c.apply(ctx, recs[done:done+n], msgs[done:done+n])
		if k > 0 {
			c.cl.MarkCommitRecords(recs[done+k-1])
			done += k
		}
		if failed != nil {
			// The next message failed in the batch already: that was its first attempt.
			if c.settleOne(ctx, recs[done], msgs[done], failed) == 0 {
				return false
			}
			c.cl.MarkCommitRecords(recs[done])
			done++
		} else if k == 0 {
			return false
		}
	}
	return true
}

// apply settles a prefix of msgs and returns its length: 0 only when ctx ended, or when the
// first message failed. failed, when set, is the error of the message right after the prefix,
// whose handler failed in this batch: the caller goes on with it alone.
func (c *BatchConsumer) apply(ctx context.Context, recs []*kgo.Record, msgs []*message.Message) (n int, failed error) {
	for failures := 0; ; failures++ {
		err := c.proc.ProcessBatch(ctx, msgs)
		if err == nil {
			return len(msgs), nil
		}
		var me *inbox.MessageError
		switch {
		case errors.As(err, &me) && len(msgs) == 1:
			return 0, me.Err
		case errors.As(err, &me) && me.Index >= 0 && me.Index < len(msgs):
			// The messages before the failing one were fine: apply them as a batch; the
			// failing one goes on alone.
			if me.Index == 0 {
				return 0, me.Err
			}
			if k, f := c.apply(ctx, recs[:me.Index], msgs[:me.Index]); k < me.Index || f != nil {
				return k, f // a prefix failed on its own (not deterministic) or ctx ended
			}
			return me.Index, me.Err
		case errors.As(err, &me):
			// A set-based handler did not say which message failed: halve until it is alone.
			return c.apply(ctx, recs[:len(msgs)/2], msgs[:len(msgs)/2])
		}
		if ctx.Err() != nil {
			return 0, nil
		}
		// The batch as a whole was refused: it counts no attempt against its messages. A
		// deadlock or serialization failure is retried at once; when it repeats, the rows the
		// batch touches are hot (other partitions update them too), and a smaller batch holds
		// fewer of their locks for less time: halve it, down to one message. (The partition's
		// next batches are full again: measured on the hot-rows test and the saga_hot row,
		// remembering a smaller size cost more in per-transaction overhead than the deadlocks
		// it avoided.)
		if failure.Contention(err) && failures > 0 && len(msgs) > 1 {
			c.log.Warn("inboxkafka: a batch keeps conflicting with concurrent transactions (hot rows); applying it in halves",
				"batch", len(msgs), "source", source(recs[0]), "err", err)
			return c.apply(ctx, recs[:len(msgs)/2], msgs[:len(msgs)/2])
		}
		if !c.policy().Refused(ctx, failures, len(msgs), source(recs[0]), err) {
			return 0, nil
		}
	}
}

// settleOne applies one failing message alone until it succeeds or is given up (1), or ctx
// ends (0), by the retry policy every consumer shares (engine.RetryPolicy). err is its first
// attempt's error.
func (c *BatchConsumer) settleOne(ctx context.Context, r *kgo.Record, msg *message.Message, err error) int {
	if c.policy().ApplyOne(ctx, c.proc, msg, source(r), err) != nil {
		return 0
	}
	return 1
}

// policy is the consumer's retry policy.
func (c *BatchConsumer) policy() engine.RetryPolicy {
	return engine.NewRetryPolicy(c.cfg.MaxAttempts, c.cfg.Backoff, c.cfg.MaxBackoff, c.log)
}

// slotted is the processor as the workers call it: each transaction holds one of the Workers
// slots while it runs, and none is held while a message waits for its next attempt, so
// partitions whose messages back off never hold up healthy ones.
type slotted struct{ c *BatchConsumer }

// After a conflict between concurrent transactions (a deadlock, a serialization failure, a
// lock timeout: hot rows that the partitions' messages share), the consumer's transactions
// run one at a time for hotFor, also with those of its other processes (engine.TakeTurns): a
// batch of hot rows is cheap, a deadlock between two costs PostgreSQL's deadlock_timeout (1 s)
// and a retry, so taking turns is faster than racing. Each new conflict extends the period;
// without one, the partitions run in parallel again.
func (s slotted) ProcessBatch(ctx context.Context, msgs []*message.Message) error {
	if !s.c.acquire(ctx) {
		return ctx.Err()
	}
	defer s.c.release()
	if time.Now().UnixNano() < s.c.hotUntil.Load() {
		// Within this process a mutex; across processes of the group (and other consumers of
		// the same name) the engines' advisory lock (engine.TakeTurns).
		s.c.hot.Lock()
		defer s.c.hot.Unlock()
		ctx = engine.TakeTurns(ctx)
	}
	err := s.c.cfg.Processor.ProcessBatch(ctx, msgs)
	if failure.Contention(err) {
		s.c.hotUntil.Store(time.Now().Add(hotFor).UnixNano())
	}
	return err
}

// hotFor is how long the consumer's transactions take turns after a conflict between two of
// them.
const hotFor = 10 * time.Second

func (s slotted) SettlePoison(ctx context.Context, msg *message.Message, p inbox.GiveUp) error {
	if !s.c.acquire(ctx) {
		return ctx.Err()
	}
	defer s.c.release()
	return s.c.cfg.Processor.SettlePoison(ctx, msg, p)
}

// SettleLater parks msg in the processor's retry lane (engine.Parker), holding a slot; a
// processor without a lane says so (engine.ErrNoLane) and the message counts a failure.
func (s slotted) SettleLater(ctx context.Context, msg *message.Message, l engine.Later) error {
	pk, ok := s.c.cfg.Processor.(engine.Parker)
	if !ok {
		return engine.ErrNoLane
	}
	if !s.c.acquire(ctx) {
		return ctx.Err()
	}
	defer s.c.release()
	return pk.SettleLater(ctx, msg, l)
}

func (c *BatchConsumer) acquire(ctx context.Context) bool {
	select {
	case c.slots <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}

func (c *BatchConsumer) release() { <-c.slots }

// Close stops the workers (batches in flight finish), commits the marked offsets and leaves
// the group. Run calls it when it returns; calling it again is a no-op.
func (c *BatchConsumer) Close() {
	c.closeOnce.Do(func() {
		c.stop(nil)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c.commitMarked(ctx, c.cl)
		c.cl.Close()
	})
}

// source names a record's place: topic/partition@offset.
func source(r *kgo.Record) string {
	return r.Topic + "/" + strconv.Itoa(int(r.Partition)) + "@" + strconv.FormatInt(r.Offset, 10)
}
