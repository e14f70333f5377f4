package relay

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// leases tracks the shard leases this relay holds and keeps them alive.
//
// Protocol (all expiry comparisons use the database clock, now()):
//   - every renewInterval the relay heartbeats its relay_member row, renews the leases it holds
//     (owner and epoch must still match) and reads the live members; its fair share of the
//     shards follows from its rank among them;
//   - it takes free or expired shards up to its share, bumping each shard's epoch (the fencing
//     token), and gives back shards above its share between two batches, when nothing of them
//     is in flight;
//   - it publishes a shard only while its last successful renewal, timed from when the renewal
//     was sent (monotonic clock), is younger than LeaseDuration minus the fence margin. The
//     database lease lasts LeaseDuration from a moment after that send, so the relay stops
//     before anyone else may take the shard. When the fence lapses, the batch in flight is
//     cancelled and every shard is dropped until it is acquired again with a new epoch.
type leases struct {
	cfg  Config
	pool *pgxpool.Pool
	q    *queries
	log  *slog.Logger
	m    Metrics
	host string
	pid  int
	// token identifies this process in its relay_member row (see join).
	token string

	mu         sync.Mutex
	owned      map[int]int64 // shard → epoch
	release    map[int]bool  // owned shards to give back at the next batch boundary
	validUntil time.Time     // publishing allowed while time.Now() is before it
	lastOK     time.Time     // last successful tick, for Health
	inflight   context.CancelFunc
	fence      *time.Timer
	ticks      int
	// gen counts acquisitions: a claim cursor from an older generation has never looked at the
	// rows of the shards acquired since, so the loop restarts it from the beginning.
	gen uint64

	changed chan struct{} // shards acquired: wake the publishing loop
}

func newLeases(cfg Config, pool *pgxpool.Pool, q *queries, m Metrics) *leases {
	host, _ := os.Hostname()
	return &leases{
		cfg: cfg, pool: pool, q: q, log: cfg.Logger, m: m, host: host, pid: os.Getpid(), token: rand.Text(),
		owned: map[int]int64{}, release: map[int]bool{},
		changed: make(chan struct{}, 1),
	}
}

// snapshot is the set of shards one batch publishes.
type snapshot struct {
	shards []int   // sorted
	epochs []int64 // indexed by shard; -1 where not owned
	all    bool    // every shard is owned: the claim needs no shard filter
	gen    uint64  // leases.gen when the snapshot was taken
}

// begin returns the shards the next batch may publish, or ok=false when none, together with a
// context that is cancelled if the fence lapses or a shard is lost while the batch runs. done
// must be called when the batch is over.
func (l *leases) begin(parent context.Context) (s snapshot, ctx context.Context, done func(), ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.owned) == 0 || !time.Now().Before(l.validUntil) {
		return snapshot{}, nil, nil, false
	}
	s.epochs = make([]int64, l.cfg.Shards)
	for i := range s.epochs {
		s.epochs[i] = -1
	}
	for shard, epoch := range l.owned {
		if l.release[shard] {
			continue
		}
		s.shards = append(s.shards, shard)
		s.epochs[shard] = epoch
	}
	if len(s.shards) == 0 {
		return snapshot{}, nil, nil, false
	}
	slices.Sort(s.shards)
	s.all = len(s.shards) == l.cfg.Shards
	s.gen = l.gen
	ctx, cancel := context.WithCancel(parent)
	l.inflight = cancel
	return s, ctx, func() {
		l.mu.Lock()
		l.inflight = nil
		l.mu.Unlock()
		cancel()
	}, true
}

// takeReleases removes the shards marked for release from the owned set and returns them with
// their epochs. Called by the publishing loop between batches.
func (l *leases) takeReleases() (shards []int, epochs []int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for shard := range l.release {
		if epoch, ok := l.owned[shard]; ok {
			shards = append(shards, shard)
			epochs = append(epochs, epoch)
			delete(l.owned, shard)
		}
		delete(l.release, shard)
	}
	if len(shards) > 0 {
		l.m.OwnedShards(len(l.owned))
	}
	return shards, epochs
}

// giveBack frees shards in the database so another relay can take them at once.
func (l *leases) giveBack(ctx context.Context, shards []int, epochs []int64) error {
	if len(shards) == 0 {
		return nil
	}
	_, err := l.pool.Exec(ctx, l.q.release, l.cfg.InstanceID, shards, epochs)
	if err != nil {
		return fmt.Errorf("release shards %v: %w", shards, err)
	}
	l.log.Info("relay released shards", "shards", len(shards))
	return nil
}

// run renews, acquires and rebalances until ctx is done, or until it finds the lease table
// resharded to another count, which it reports through stop.
func (l *leases) run(ctx context.Context, stop func(error)) {
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		// A renewal that takes longer than the lease is useless (the fence has lapsed), and a
		// connection that died silently must not hang the relay until TCP gives up.
		tctx, cancel := context.WithTimeout(ctx, l.cfg.LeaseDuration)
		err := l.tick(tctx)
		cancel()
		if ctx.Err() == nil {
			l.m.LeaseRenewal(err == nil) // metrics.go
		}
		if errors.Is(err, ErrShardCountMismatch) || errors.Is(err, ErrInstanceIDInUse) {
			stop(err)
			return
		}
		if err != nil && ctx.Err() == nil {
			l.m.Failed(FailureDatabase, 1)
			l.log.Warn("relay lease renewal failed; publishing continues until the lease fence, then stops until the database answers again",
				"err", err, "fence_in", time.Until(l.fenceDeadline()).Round(time.Millisecond))
		}
		t.Reset(l.cfg.renewInterval())
	}
}

func (l *leases) fenceDeadline() time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.validUntil
}

// tick is one renewal round trip, plus an acquisition when below the fair share.
func (l *leases) tick(ctx context.Context) error {
	l.mu.Lock()
	shards := make([]int, 0, len(l.owned))
	epochs := make([]int64, 0, len(l.owned))
	for shard, epoch := range l.owned {
		shards = append(shards, shard)
		epochs = append(epochs, epoch)
	}
	l.ticks++
	cleanup := l.ticks%100 == 1
	l.mu.Unlock()

	secs := l.cfg.LeaseDuration.Seconds()
	sent := time.Now()
	b := &pgx.Batch{}
	b.Queue(l.q.heartbeat, l.cfg.InstanceID, l.host, l.pid, secs, l.token)
	b.Queue(l.q.renew, l.cfg.InstanceID, secs, shards, epochs)
	b.Queue(l.q.members)
	b.Queue(l.q.shardCount)
	if cleanup {
		b.Queue(l.q.forgetMembers)
	}
	renewed := map[int]int64{}
	var members []string
	var tableShards int
	err := func() error {
		br := l.pool.SendBatch(ctx, b)
		defer func() { _ = br.Close() }() // closed explicitly below on success
		tag, err := br.Exec()
		if err != nil {
			return fmt.Errorf("heartbeat: %w", err)
		}
		if tag.RowsAffected() == 0 {
			return l.idInUse(ctx, "another process took over")
		}
		rows, err := br.Query()
		if err != nil {
			return fmt.Errorf("renew leases: %w", err)
		}
		var shard int
		var epoch int64
		if _, err := pgx.ForEachRow(rows, []any{&shard, &epoch}, func() error { renewed[shard] = epoch; return nil }); err != nil {
			return fmt.Errorf("renew leases: %w", err)
		}
		rows, err = br.Query()
		if err != nil {
			return fmt.Errorf("read members: %w", err)
		}
		members, err = pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return fmt.Errorf("read members: %w", err)
		}
		if err := br.QueryRow().Scan(&tableShards); err != nil {
			return fmt.Errorf("read shard count: %w", err)
		}
		if cleanup {
			if _, err := br.Exec(); err != nil {
				return fmt.Errorf("forget dead members: %w", err)
			}
		}
		return br.Close()
	}()
	if err != nil {
		return err
	}
	if tableShards != l.cfg.Shards {
		// Resharded while this relay was cut off or paused: its leases are gone with the old
		// table, and the shards of the new one mean other keys. Stop publishing at once.
		l.mu.Lock()
		clear(l.owned)
		clear(l.release)
		if l.inflight != nil {
			l.inflight()
		}
		l.m.OwnedShards(0)
		l.mu.Unlock()
		return shardMismatch(l.cfg, tableShards)
	}

	target := fairShare(members, l.cfg.InstanceID, l.cfg.Shards)
	l.mu.Lock()
	var lost []int
	for _, shard := range shards {
		if e, ok := renewed[shard]; !ok || e != l.owned[shard] {
			if _, still := l.owned[shard]; still {
				lost = append(lost, shard)
				delete(l.owned, shard)
				delete(l.release, shard)
			}
		}
	}
	if len(lost) > 0 && l.inflight != nil {
		l.inflight() // stop publishing the lost shards now
	}
	l.extendLocked(sent)
	excess := len(l.owned) - len(l.release) - target
	if excess > 0 {
		// Give back the highest shards not already on their way out.
		var keep []int
		for shard := range l.owned {
			if !l.release[shard] {
				keep = append(keep, shard)
			}
		}
		sort.Sort(sort.Reverse(sort.IntSlice(keep)))
		for _, shard := range keep[:excess] {
			l.release[shard] = true
		}
	}
	need := target - len(l.owned)
	mine := []int{} // not nil: NULL would make "shard <> ALL(NULL)" false for every shard
	for shard := range l.owned {
		mine = append(mine, shard)
	}
	l.lastOK = time.Now()
	l.mu.Unlock()
	if len(lost) > 0 {
		l.log.Warn("relay lost shard leases to another relay; stopped publishing them", "shards", lost)
	}

	if need > 0 {
		rows, err := l.pool.Query(ctx, l.q.acquire, l.cfg.InstanceID, secs, need, mine, l.cfg.Shards)
		if err != nil {
			return fmt.Errorf("acquire shards: %w", err)
		}
		got := map[int]int64{}
		var shard int
		var epoch int64
		if _, err := pgx.ForEachRow(rows, []any{&shard, &epoch}, func() error { got[shard] = epoch; return nil }); err != nil {
			return fmt.Errorf("acquire shards: %w", err)
		}
		if len(got) > 0 {
			l.mu.Lock()
			for shard, epoch := range got {
				l.owned[shard] = epoch
			}
			l.gen++
			// The new leases were written after `sent`, so the fence computed from it is
			// conservative for them too.
			n := len(l.owned)
			l.mu.Unlock()
			l.log.Info("relay acquired shards", "acquired", len(got), "owned", n, "target", target, "members", len(members))
			select {
			case l.changed <- struct{}{}:
			default:
			}
		}
	}
	l.mu.Lock()
	l.m.OwnedShards(len(l.owned))
	l.mu.Unlock()
	return nil
}

// extendLocked moves the fence after a successful renewal sent at `sent`, and arms the timer
// that drops every shard if no further renewal succeeds in time.
func (l *leases) extendLocked(sent time.Time) {
	l.validUntil = sent.Add(l.cfg.LeaseDuration - l.cfg.fenceMargin())
	wait := time.Until(l.validUntil)
	if l.fence == nil {
		l.fence = time.AfterFunc(wait, l.fenceLapsed)
	} else {
		l.fence.Reset(wait)
	}
}

func (l *leases) fenceLapsed() {
	l.mu.Lock()
	if time.Now().Before(l.validUntil) || len(l.owned) == 0 {
		l.mu.Unlock()
		return
	}
	n := len(l.owned)
	clear(l.owned)
	clear(l.release)
	if l.inflight != nil {
		l.inflight()
	}
	l.m.OwnedShards(0)
	l.mu.Unlock()
	l.log.Warn("relay could not renew its shard leases in time; stopped publishing every shard until it re-acquires them", "shards", n)
}

// stop disarms the fence timer.
func (l *leases) stop() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.fence != nil {
		l.fence.Stop()
	}
}

// releaseAll gives every lease back and removes the membership row, so the other relays take
// over at their next renewal instead of waiting for expiry.
func (l *leases) releaseAll(ctx context.Context) error {
	l.mu.Lock()
	var shards []int
	var epochs []int64
	for shard, epoch := range l.owned {
		shards = append(shards, shard)
		epochs = append(epochs, epoch)
	}
	clear(l.owned)
	clear(l.release)
	l.m.OwnedShards(0)
	l.mu.Unlock()
	return errors.Join(l.giveBack(ctx, shards, epochs), l.leave(ctx))
}

func (l *leases) leave(ctx context.Context) error {
	if _, err := l.pool.Exec(ctx, l.q.leave, l.cfg.InstanceID, l.token); err != nil {
		return fmt.Errorf("remove relay member row: %w", err)
	}
	return nil
}

// ErrInstanceIDInUse is returned by Run when another live relay process uses the same
// Config.InstanceID (ONCEFLOW_RELAY_ID, --id): two processes sharing an id would take each
// other's shards at every renewal and publish duplicates. Leave the id unset (the default,
// "<hostname>-<pid>", is unique) or give every replica its own.
var ErrInstanceIDInUse = errors.New("relay: instance id in use by another live relay")

// join makes this process the holder of its instance id in relay_member before the relay
// starts. A row of another process whose heartbeat is current is waited on for one and a half
// renewal intervals: if its heartbeat moved meanwhile, that relay is alive and this one refuses
// to start (ErrInstanceIDInUse); if not, it stopped without leaving (crash, SIGKILL), and this
// process takes the id over with its leases, as a restart with the same id should.
func (l *leases) join(ctx context.Context) error {
	secs := l.cfg.LeaseDuration.Seconds()
	take := func(seen *time.Time) (bool, error) {
		tag, err := l.pool.Exec(ctx, l.q.join, l.cfg.InstanceID, l.host, l.pid, secs, l.token, seen)
		if err != nil {
			return false, fmt.Errorf("relay: register as member %q: %w", l.cfg.InstanceID, err)
		}
		return tag.RowsAffected() == 1, nil
	}
	if ok, err := take(nil); ok || err != nil {
		return err
	}
	var host string
	var pid int
	var beat time.Time
	var age time.Duration
	if err := l.pool.QueryRow(ctx, l.q.holder, l.cfg.InstanceID).Scan(&host, &pid, &beat, &age); err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return l.join(ctx) // it just left
		}
		return fmt.Errorf("relay: read member %q: %w", l.cfg.InstanceID, err)
	}
	wait := l.cfg.renewInterval() * 3 / 2
	l.log.Info("relay id is registered by another process; waiting to see whether it is alive",
		"id", l.cfg.InstanceID, "host", host, "pid", pid, "last_heartbeat", age.Round(time.Millisecond), "wait", wait)
	t := time.NewTimer(wait)
	select {
	case <-ctx.Done():
		t.Stop()
		return ctx.Err()
	case <-t.C:
	}
	if ok, err := take(&beat); ok || err != nil {
		if ok {
			l.log.Info("relay took over its id from a process that stopped heartbeating", "id", l.cfg.InstanceID, "host", host, "pid", pid)
		}
		return err
	}
	return l.idInUse(ctx, "refusing to start")
}

// idInUse builds ErrInstanceIDInUse's error, naming the process holding the id.
func (l *leases) idInUse(ctx context.Context, what string) error {
	var host string
	var pid int
	var beat time.Time
	var age time.Duration
	holder := "another process"
	if err := l.pool.QueryRow(ctx, l.q.holder, l.cfg.InstanceID).Scan(&host, &pid, &beat, &age); err == nil {
		holder = fmt.Sprintf("the relay on host %q, pid %d (heartbeat %s ago)", host, pid, age.Round(time.Millisecond))
	}
	return fmt.Errorf("%w: %s: id %q is held by %s. Give every relay process its own id: leave --id / ONCEFLOW_RELAY_ID unset (the default <hostname>-<pid> is unique) or set a different one per replica",
		ErrInstanceIDInUse, what, l.cfg.InstanceID, holder)
}

func (l *leases) healthy() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lastOK.IsZero() {
		return errors.New("relay: no lease renewal has succeeded yet")
	}
	if age := time.Since(l.lastOK); age > l.cfg.LeaseDuration {
		return fmt.Errorf("relay: last successful lease renewal %s ago (database unreachable?)", age.Round(time.Millisecond))
	}
	return nil
}

// fairShare is how many of the shards the member `me` should hold: an equal split among the
// live members sorted by id, the first ones taking one extra when it does not divide evenly.
func fairShare(members []string, me string, shards int) int {
	idx := slices.Index(members, me)
	n := len(members)
	if idx < 0 {
		idx, n = n, n+1 // not visible yet: count ourselves last
	}
	share := shards / n
	if idx < shards%n {
		share++
	}
	return share
}
