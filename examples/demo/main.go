// Command demo runs the example shop end to end and tries to break it: `make demo`.
//
//	customers ──POST /orders + Idempotency-Key──▶ orders ──checkout saga──▶ inventory, payments
//	orders ──OrderCreated/Confirmed/Cancelled, OrderReminder (scheduled)──▶ projection
//
// Every service is a child process with its own schema, and its own `onceflow relay` child
// process publishing its outbox to Kafka. The scenario: customers order concurrently; clients
// retry with the same key (while the first request is in flight, after a dropped connection,
// after a lost answer) and reuse a key with a different body; a replayer injects duplicate
// deliveries into every topic; the orders relay and the payments service are SIGKILLed
// mid-stream and restarted; the payment provider has three short outages, during which the
// charges ask to be retried later (inbox.RetryAfter); one customer goes over his limit and is
// declined, a scarce product runs out, and those sagas compensate. Every order schedules a
// reminder (outbox.DeliverAfter) that its cancellation withdraws (outbox's CancelTx). At the
// end, dedup rows of a few finished charges are deleted (as an early retention cleanup would)
// and the charges redelivered, to show the payment's second barrier. Then it prints a table
// of invariants and exits non-zero if one fails.
//
// With nothing configured it starts a throwaway PostgreSQL and an in-process Kafka (kfake);
// with DATABASE_URL / KAFKA_BROKERS set it uses those (in schemas and topics of its own).
//
// With -ha (make demo-ha) PostgreSQL is a primary and a synchronous streaming standby, every
// service and relay connects with one multi-host URL (target_session_attrs=read-write), and
// the faults add a failover: the primary is killed mid-stream and the standby promoted. The
// invariants are the same.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/examples/internal/checkout"
	"github.com/onceflow/onceflow/examples/internal/platform"
)

// httpc is the demo's client for the services' operational endpoints.
var httpc = &http.Client{Timeout: 5 * time.Second}

type options struct {
	bin               string
	ordersPerCustomer int
	duration          time.Duration
	replay            float64
	limit             int64
	lostDedup         int
	remindAfter       time.Duration
	outage            time.Duration
	retryAfter        time.Duration
	timeout           time.Duration
	ha                bool
}

func main() {
	var o options
	flag.StringVar(&o.bin, "bin", "bin", "directory with the onceflow binary and examples/{orders,inventory,payments,projection} (make demo builds them)")
	flag.IntVar(&o.ordersPerCustomer, "orders", 40, "orders each of the six customers places")
	flag.DurationVar(&o.duration, "duration", 12*time.Second, "how long the customers spread their orders over")
	flag.Float64Var(&o.replay, "replay", 0.08, "share of Kafka records re-delivered as duplicates")
	flag.Int64Var(&o.limit, "limit", 100_000, "what a customer may spend at the payment provider, in cents")
	flag.IntVar(&o.lostDedup, "lost-dedup", 5, "finished charges redelivered after their dedup rows were deleted")
	flag.DurationVar(&o.remindAfter, "remind-after", 2*time.Second, "when an order's reminder (a scheduled message) is due, after the order")
	flag.DurationVar(&o.outage, "outage", 600*time.Millisecond, "how long each of the payment provider's three outages lasts (0: none)")
	flag.DurationVar(&o.retryAfter, "retry-after", 750*time.Millisecond, "the wait a charge refused by the provider asks for (inbox.RetryAfter)")
	flag.DurationVar(&o.timeout, "timeout", 50*time.Second, "give up if the shop has not settled by then")
	flag.BoolVar(&o.ha, "ha", false, "PostgreSQL as a primary and a synchronous standby: the primary is killed mid-stream and the standby promoted (make demo-ha; DATABASE_URL must be unset)")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ok, err := run(ctx, o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
	if !ok {
		os.Exit(1)
	}
}

// svc is a service child process with its schema and counters.
type svc struct {
	*proc
	schema   string
	counters counters
}

// shop is everything the demo started.
type shop struct {
	pool                                    *pgxpool.Pool
	topics                                  checkout.Topics
	orders, inventory, payments, projection *svc
	relays                                  map[string]*proc // by service name
	client                                  *client
	rep                                     *replayer
	start                                   time.Time
	outages                                 atomic.Int64 // the payment provider's, injected
	failovers                               int          // with -ha: primaries killed, standbys promoted
}

func (s *shop) services() []*svc { return []*svc{s.orders, s.inventory, s.payments, s.projection} }

func (s *shop) procs() []*proc {
	ps := []*proc{}
	for _, sv := range s.services() {
		if sv != nil {
			ps = append(ps, sv.proc)
		}
	}
	for _, name := range []string{"orders", "inventory", "payments"} {
		ps = append(ps, s.relays[name])
	}
	return ps
}

// t qualifies a table with a service's schema.
func t(sv *svc, table string) string { return pgx.Identifier{sv.schema, table}.Sanitize() }

func run(ctx context.Context, o options) (bool, error) {
	s := &shop{start: time.Now(), relays: map[string]*proc{}}
	defer httpc.CloseIdleConnections()
	onceflow, err := filepath.Abs(filepath.Join(o.bin, "onceflow"))
	if err != nil {
		return false, err
	}
	for _, name := range []string{"onceflow", "examples/orders", "examples/inventory", "examples/payments", "examples/projection"} {
		if _, err := os.Stat(filepath.Join(o.bin, name)); err != nil {
			return false, fmt.Errorf("%s not found in %s: run `make demo` (it builds them) or pass -bin", name, o.bin)
		}
	}

	// Infrastructure: embedded unless configured. On real servers the run gets schemas and
	// topics of its own.
	schemaPrefix, topicPrefix := "", ""
	start := platform.StartEmbedded
	if o.ha {
		start = platform.StartEmbeddedPair
	}
	infra, err := start(ctx)
	if err != nil {
		return false, err
	}
	defer infra.Stop()
	dbURL, brokers := infra.DatabaseURL, infra.Brokers
	if o.ha {
		fmt.Println("▸ PostgreSQL: a primary and a synchronous streaming standby, one multi-host URL (target_session_attrs=read-write)")
	} else if infra.StartedDB {
		fmt.Println("▸ PostgreSQL: a throwaway cluster from the installed binaries (DATABASE_URL unset)")
	} else {
		schemaPrefix = "demo_" + randomHex(3) + "_"
		fmt.Println("▸ PostgreSQL: DATABASE_URL, schemas " + schemaPrefix + "*")
	}
	if infra.StartedKafka {
		fmt.Printf("▸ Kafka: in-process kfake, %d partitions per topic (KAFKA_BROKERS unset)\n", platform.Partitions)
	} else {
		topicPrefix = "demo-" + randomHex(3) + "."
		fmt.Println("▸ Kafka: KAFKA_BROKERS, topics " + topicPrefix + "*")
	}
	s.topics = checkout.NewTopics(topicPrefix)
	if err := platform.CreateTopics(ctx, brokers, s.topics.All()...); err != nil {
		return false, err
	}
	if s.pool, err = pgxpool.New(ctx, dbURL); err != nil {
		return false, err
	}
	defer s.pool.Close()
	if schemaPrefix != "" {
		defer s.dropSchemas()
	}

	// The services, each a child process on its own schema; then a relay per outbox.
	env := []string{"DATABASE_URL=" + dbURL, "KAFKA_BROKERS=" + strings.Join(brokers, ",")}
	newSvc := func(name string, extra ...string) (*svc, error) {
		addr, err := freeAddr()
		if err != nil {
			return nil, err
		}
		bin, _ := filepath.Abs(filepath.Join(o.bin, "examples", name))
		sv := &svc{schema: schemaPrefix + name, proc: &proc{name: name, bin: bin, addr: addr, env: env}}
		sv.args = append([]string{"-addr", addr, "-schema", sv.schema, "-relay=false", "-topic-prefix", topicPrefix,
			"-instance", "demo-" + name, "-log-level", "warn"}, extra...)
		return sv, nil
	}
	// -wait-in-flight 0: a retry that arrives while its first request runs is answered 409
	// (request-in-flight) instead of waiting, so the demo can count them.
	if s.orders, err = newSvc("orders", "-wait-in-flight", "0", "-remind-after", o.remindAfter.String()); err != nil {
		return false, err
	}
	if s.inventory, err = newSvc("inventory"); err != nil {
		return false, err
	}
	if s.payments, err = newSvc("payments", "-limit", fmt.Sprint(o.limit), "-retry-after", o.retryAfter.String()); err != nil {
		return false, err
	}
	if s.projection, err = newSvc("projection"); err != nil {
		return false, err
	}
	defer s.stopAll()
	for _, sv := range s.services() {
		if err := sv.start(); err != nil {
			return false, err
		}
	}
	for _, sv := range s.services() {
		if err := sv.waitHealthy(ctx, 30*time.Second); err != nil {
			return false, err
		}
	}
	for _, sv := range []*svc{s.orders, s.inventory, s.payments} {
		// The connection string goes in the environment (DATABASE_URL, KAFKA_BROKERS), not on
		// the command line, where every user of the machine could read a password in it.
		r := &proc{name: sv.name + " relay", bin: onceflow, env: env, args: []string{"relay",
			"--schema", sv.schema, "--id", "demo-" + sv.name, "--log-level", "warn"}}
		if err := r.start(); err != nil {
			return false, err
		}
		s.relays[sv.name] = r
	}
	fmt.Printf("▸ started in %.1fs: orders, inventory, payments, projection, and a `onceflow relay` for each outbox\n\n", time.Since(s.start).Seconds())

	rctx, stopReplay := context.WithCancel(ctx)
	defer stopReplay()
	if s.rep, err = startReplayer(rctx, brokers, s.topics.All(), s.topics.Charge, o.replay); err != nil {
		return false, err
	}
	defer s.rep.close()

	// The customers.
	s.client = newClient(s.orders.addr)
	defer s.client.http.CloseIdleConnections()
	total := o.ordersPerCustomer * len(shoppers)
	interval := o.duration / time.Duration(o.ordersPerCustomer)
	sctx, stopShopping := context.WithCancel(ctx)
	var shopping sync.WaitGroup
	defer func() { stopShopping(); shopping.Wait() }() // on an early return too
	for i, sh := range shoppers {
		shopping.Go(func() { s.client.shop(sctx, sh, o.ordersPerCustomer, interval, uint64(i+1)) })
	}
	trafficDone := make(chan struct{})
	go func() { shopping.Wait(); close(trafficDone) }()

	deadline := time.Now().Add(o.timeout)
	faults := []fault{
		{at: total * 30 / 100, do: func() error { return s.restart(ctx, s.relays["orders"], nil) }},
		{at: total * 55 / 100, do: func() error { return s.restart(ctx, s.payments.proc, s.payments) }},
	}
	if o.ha { // between the two crashes, in the order they fire
		faults = slices.Insert(faults, 1, fault{at: total * 42 / 100, do: func() error { return s.failover(ctx, infra) }})
	}
	octx, stopOutages := context.WithCancel(ctx)
	var outages sync.WaitGroup
	defer func() { stopOutages(); outages.Wait() }() // on an early return too
	if o.outage > 0 {
		outages.Go(func() { s.providerOutages(octx, total, o.outage) })
	}
	if err := s.watch(ctx, deadline, trafficDone, faults); err != nil {
		return false, err
	}
	s.rep.on.Store(false) // the traffic is over: no more injected duplicates
	if err := s.settle(ctx, deadline); err != nil {
		fmt.Println("  ✗", err)
	}
	stopOutages()
	outages.Wait()
	// The last outage may have begun just before the traffic settled. A charge redelivered
	// while it lasts is refused and answered "retry later" to a saga that has finished, which
	// re-sends nothing: the second barrier would never see it.
	if err := s.waitProviderUp(ctx, deadline); err != nil {
		return false, err
	}
	hits := s.payments.counters.get("unique_constraint_hits")
	redelivered, err := s.loseDedup(ctx, o.lostDedup)
	if err != nil {
		return false, err
	}
	lost := len(redelivered)
	if lost > 0 {
		fmt.Printf("  ✗ deleted the payments dedup rows of %d confirmed orders and redelivered their charges (an early retention cleanup, a consumer group reset)\n", lost)
		want := hits + int64(lost)
		for s.payments.counters.get("unique_constraint_hits") < want && time.Now().Before(deadline) {
			time.Sleep(100 * time.Millisecond)
			s.payments.counters.poll(s.payments.addr)
		}
		if s.payments.counters.get("unique_constraint_hits") < want {
			s.explainRedelivered(ctx, redelivered)
		}
	}
	if err := s.settle(ctx, deadline); err != nil {
		fmt.Println("  ✗", err)
	}
	rows, err := s.check(ctx, o, lost)
	if err != nil {
		return false, err
	}
	rows = append(rows, s.stopAll()...)
	return report(rows, time.Since(s.start)), nil
}

// fault is a crash injected when the customers have placed at orders.
type fault struct {
	at   int
	do   func() error
	done bool
}

// watch prints progress every second, injects the faults and returns when the customers are
// done.
func (s *shop) watch(ctx context.Context, deadline time.Time, trafficDone <-chan struct{}, faults []fault) error {
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	last := time.Time{}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-trafficDone:
			s.progress(ctx)
			return nil
		case <-tick.C:
		}
		for _, p := range s.procs() {
			if p.failed() {
				return fmt.Errorf("%s exited on its own; see its log lines above", p.name)
			}
		}
		for _, sv := range s.services() {
			sv.counters.poll(sv.addr)
		}
		for i := range faults {
			f := &faults[i]
			if !f.done && s.client.accepted.Load() >= int64(f.at) {
				f.done = true
				if err := f.do(); err != nil {
					return err
				}
			}
		}
		if time.Since(last) >= time.Second {
			last = time.Now()
			s.progress(ctx)
		}
		if time.Now().After(deadline) {
			return errors.New("the customers did not finish in time")
		}
	}
}

// providerOutages takes the fake payment provider down for d three times, when it has seen
// the charges of 15%, 40% and 65% of the orders, and at least two seconds apart: timed by the
// charges, not by the orders or the clock, so that every outage meets charges in flight
// however far the sagas lag behind the customers. Meanwhile the provider answers every charge
// "unavailable" (the outage is a row of its own table, so a payments restart does not end
// it), and payments asks the saga to retry those charges later. It returns after the third
// outage or when ctx ends.
func (s *shop) providerOutages(ctx context.Context, orders int, d time.Duration) {
	thresholds := []int{orders * 15 / 100, orders * 40 / 100, orders * 65 / 100}
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	var last time.Time
	for len(thresholds) > 0 {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		var charges int
		err := s.pool.QueryRow(ctx, `SELECT count(*) FROM `+t(s.payments, "fake_provider_charge")).Scan(&charges)
		if err != nil || charges < thresholds[0] || time.Since(last) < 2*time.Second {
			continue
		}
		thresholds, last = thresholds[1:], time.Now()
		if _, err := s.pool.Exec(ctx, `INSERT INTO `+t(s.payments, "fake_provider_outage")+` (down_until)
			VALUES (now() + $1 * interval '1 microsecond')`, d.Microseconds()); err != nil {
			if ctx.Err() == nil {
				fmt.Println("  payment provider outage:", err)
			}
			continue
		}
		s.outages.Add(1)
		fmt.Printf("  ✗ the payment provider is down for %s, after %d charges: it answers \"unavailable\"\n", d, charges)
	}
}

// failover kills the PostgreSQL primary mid-stream and promotes its synchronous standby. The
// services and relays find the new primary through their multi-host URL; the demo's own pool
// drops its connections to the dead one, which a query would otherwise meet first.
func (s *shop) failover(ctx context.Context, infra *platform.Embedded) error {
	t0 := time.Now()
	if err := infra.Failover(ctx); err != nil {
		return err
	}
	s.failovers++
	s.pool.Reset()
	fmt.Printf("  ✗ PostgreSQL primary killed (pg_ctl stop -m immediate) after %d orders; the standby was promoted %.1fs later\n",
		s.client.accepted.Load(), time.Since(t0).Seconds())
	return nil
}

// restart SIGKILLs p mid-stream and starts it again a second later.
func (s *shop) restart(ctx context.Context, p *proc, sv *svc) error {
	if sv != nil {
		sv.counters.poll(sv.addr) // its counters die with it: keep the last reading
	}
	pid := p.pid()
	p.kill()
	if sv != nil {
		sv.counters.restart()
	}
	time.Sleep(time.Second) // the stream moves on without it
	if err := p.start(); err != nil {
		return err
	}
	if sv != nil {
		if err := sv.waitHealthy(ctx, 20*time.Second); err != nil {
			return err
		}
	}
	fmt.Printf("  ✗ %s (pid %d) SIGKILLed mid-stream; restarted as pid %d\n", p.name, pid, p.pid())
	return nil
}

func (s *shop) progress(ctx context.Context) {
	var pending, confirmed, cancelled, outboxRows, waiting, reminded int64
	err := s.pool.QueryRow(ctx, `SELECT
		count(*) FILTER (WHERE status = 'pending'), count(*) FILTER (WHERE status = 'confirmed'),
		count(*) FILTER (WHERE status = 'cancelled'),
		(SELECT count(*) FROM `+t(s.orders, "outbox_scheduled")+`), (SELECT count(*) FROM `+t(s.projection, "order_reminder")+`)
		FROM `+t(s.orders, "orders")).Scan(&pending, &confirmed, &cancelled, &waiting, &reminded)
	if err == nil {
		outboxRows, err = s.outboxRows(ctx)
	}
	if err != nil {
		fmt.Println("  progress:", err)
		return
	}
	c := s.client
	fmt.Printf("  %5.1fs  orders %3d  replays %2d  dropped %2d  reused keys %2d │ confirmed %3d  cancelled %3d  running %2d │ outbox rows %3d │ reminders waiting %3d  sent %3d │ duplicates injected %3d\n",
		time.Since(s.start).Seconds(), c.accepted.Load(), c.replays.Load(), c.dropped.Load(), c.reuses.Load(),
		confirmed, cancelled, pending, outboxRows, waiting, reminded, s.rep.total())
}

func (s *shop) outboxRows(ctx context.Context) (int64, error) {
	var n int64
	err := s.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+t(s.orders, "outbox")+`) + (SELECT count(*) FROM `+
		t(s.inventory, "outbox")+`) + (SELECT count(*) FROM `+t(s.payments, "outbox")+`)`).Scan(&n)
	return n, err
}

// settle waits until no order is pending, the outboxes are empty, every reminder not withdrawn
// was due, published and received, and the services' counters have not moved for a second and
// a half: every message, duplicates included, was handled.
func (s *shop) settle(ctx context.Context, deadline time.Time) error {
	var prev string
	stableSince := time.Now()
	for {
		for _, sv := range s.services() {
			sv.counters.poll(sv.addr)
		}
		var pending, rows, projected, orders, scheduled, toRemind, reminded int64
		err := s.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+t(s.orders, "orders")+` WHERE status = 'pending'),
			(SELECT count(*) FROM `+t(s.orders, "orders")+`),
			(SELECT count(*) FROM `+t(s.projection, "order_projection")+` WHERE status <> 'pending'),
			(SELECT count(*) FROM `+t(s.orders, "outbox_scheduled")+`),
			(SELECT count(*) FROM `+t(s.orders, "orders")+` WHERE reminder IN ('scheduled', 'too late')),
			(SELECT count(*) FROM `+t(s.projection, "order_reminder")+`)`).Scan(&pending, &orders, &projected, &scheduled, &toRemind, &reminded)
		if err == nil {
			rows, err = s.outboxRows(ctx)
		}
		if err != nil {
			return err
		}
		var fp strings.Builder
		for _, sv := range s.services() {
			fmt.Fprint(&fp, sv.counters.snapshot())
		}
		fmt.Fprint(&fp, pending, rows, projected, scheduled, reminded)
		if fp.String() != prev {
			prev, stableSince = fp.String(), time.Now()
		}
		if pending == 0 && rows == 0 && projected == orders && scheduled == 0 && reminded >= toRemind &&
			time.Since(stableSince) >= 1500*time.Millisecond {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not settled in time: %d orders pending, %d outbox rows, %d reminders scheduled, %d of %d received",
				pending, rows, scheduled, reminded, toRemind)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// chargeDedupRows selects, in payments' processed_event, the dedup and barrier rows of the
// charge step of the saga (order) $1.
const chargeDedupRows = `consumer = 'payments' AND dedup_key LIKE '%' || $1 || '":"charge":%'`

// loseDedup deletes the payments service's dedup (and barrier) rows of n confirmed orders'
// charges and redelivers the charge commands: the first barrier no longer knows them.
func (s *shop) loseDedup(ctx context.Context, n int) ([]string, error) {
	rows, err := s.pool.Query(ctx, `SELECT id::text FROM `+t(s.orders, "orders")+` WHERE status = 'confirmed' ORDER BY created_at LIMIT 50`)
	if err != nil {
		return nil, err
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, err
	}
	var done []string
	for _, id := range ids {
		if len(done) == n {
			break
		}
		rec := s.rep.charge(id)
		if rec == nil {
			continue
		}
		if _, err := s.pool.Exec(ctx, `DELETE FROM `+t(s.payments, "processed_event")+` WHERE `+chargeDedupRows, id); err != nil {
			return done, err
		}
		if s.rep.produce(ctx, rec, false) {
			done = append(done, id)
		}
	}
	return done, nil
}

// waitProviderUp returns once no outage of the fake payment provider is under way.
func (s *shop) waitProviderUp(ctx context.Context, deadline time.Time) error {
	for {
		var down bool
		if err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM `+t(s.payments, "fake_provider_outage")+`
			WHERE clock_timestamp() >= down_from AND clock_timestamp() < down_until)`).Scan(&down); err != nil || !down {
			return err
		}
		if time.Now().After(deadline) {
			return errors.New("the payment provider's outage did not end in time")
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// explainRedelivered says, for charges redelivered by loseDedup that payments did not catch in
// time, how far each got: consumed (its dedup rows are back) or not, and how often the
// provider saw its key.
func (s *shop) explainRedelivered(ctx context.Context, orders []string) {
	for _, id := range orders {
		var dedup, requests int64
		err := s.pool.QueryRow(ctx, `SELECT
			(SELECT count(*) FROM `+t(s.payments, "processed_event")+` WHERE `+chargeDedupRows+`),
			(SELECT coalesce(max(requests), 0) FROM `+t(s.payments, "fake_provider_charge")+` WHERE idempotency_key = 'saga:' || $1 || ':charge')`,
			id).Scan(&dedup, &requests)
		if err != nil {
			fmt.Printf("  ✗ order %s's redelivered charge: %v\n", id, err)
			continue
		}
		fmt.Printf("  ✗ order %s's redelivered charge not caught in time: %d dedup rows of its charge now (0: not consumed yet), the provider saw its key %d times\n",
			id, dedup, requests)
	}
}

// dropSchemas removes the run's schemas from a real server (an embedded one is removed whole).
func (s *shop) dropSchemas() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, sv := range s.services() {
		if sv == nil {
			continue
		}
		if _, err := s.pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{sv.schema}.Sanitize()+" CASCADE"); err != nil {
			fmt.Fprintf(os.Stderr, "demo: drop schema %s: %v\n", sv.schema, err)
		}
	}
}

// stopAll stops every child with SIGTERM and reports whether each stopped cleanly. Safe to
// call twice.
func (s *shop) stopAll() []row {
	var bad []string
	n := 0
	for _, p := range s.procs() {
		if p == nil {
			continue
		}
		n++
		if err := p.stop(); err != nil {
			bad = append(bad, err.Error())
		}
	}
	if len(bad) > 0 {
		fmt.Println("  ✗ " + strings.Join(bad, "\n  ✗ "))
	}
	return []row{{"every service and relay stops cleanly on SIGTERM", fmt.Sprintf("%d/%d exited 0", n-len(bad), n), len(bad) == 0}}
}

// counters are a service's /debug/counters, summed over its lives (a SIGKILL loses the
// increments after the last reading).
type counters struct {
	mu         sync.Mutex
	base, last map[string]int64
}

func (c *counters) poll(addr string) {
	resp, err := httpc.Get("http://" + addr + "/debug/counters")
	if err != nil {
		return
	}
	defer resp.Body.Close()
	var m map[string]int64
	if json.NewDecoder(resp.Body).Decode(&m) == nil {
		c.mu.Lock()
		c.last = m
		c.mu.Unlock()
	}
}

// restart carries the last reading over to the next life of the process.
func (c *counters) restart() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.base == nil {
		c.base = map[string]int64{}
	}
	for k, v := range c.last {
		c.base[k] += v
	}
	c.last = nil
}

func (c *counters) get(name string) int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.base[name] + c.last[name]
}

func (c *counters) snapshot() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return fmt.Sprint(c.base, c.last)
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
