package main

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/migrations"
)

// Shared by the peer rows (saga_vs_dbos, effect_vs_river): a database of its own for a peer
// on the bench's server, completion bookkeeping keyed by the unit of work's number, and CPU
// accounting for the bench process and the PostgreSQL server.

// freshDatabase creates an empty database on the bench's server (dropping one left by an
// earlier run) and returns its URL and a pool on it with the same size as freshSchema's. Each
// system of a peer row gets a database of its own: each brings its own schema and migrations
// (DBOS its "dbos" schema, River its river_* tables in the search path, onceflow its migrated
// schema), and the database's commit counter then counts that system's transactions only.
func (e *env) freshDatabase(ctx context.Context, name string) (*pgxpool.Pool, string, error) {
	e.n++
	db := fmt.Sprintf("bench_%s_%d", name, e.n)
	admin, err := pgx.Connect(ctx, e.pgURL)
	if err != nil {
		return nil, "", err
	}
	defer func() { _ = admin.Close(ctx) }()
	if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgsql.Ident(db)+" WITH (FORCE)"); err != nil {
		return nil, "", err
	}
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgsql.Ident(db)); err != nil {
		return nil, "", err
	}
	u, err := url.Parse(e.pgURL)
	if err != nil {
		return nil, "", fmt.Errorf("DATABASE_URL must be a postgres:// URL for the peer rows: %w", err)
	}
	u.Path = "/" + db
	cfg, err := pgxpool.ParseConfig(u.String())
	if err != nil {
		return nil, "", err
	}
	cfg.MaxConns = 32
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, "", err
	}
	return pool, u.String(), nil
}

// freshOnceflowDatabase is freshDatabase with onceflow's schema migrated into it (schema
// "onceflow", first in the pool's search path, as freshSchema's).
func (e *env) freshOnceflowDatabase(ctx context.Context, name string) (*pgxpool.Pool, string, error) {
	const schema = "onceflow"
	pool, _, err := e.freshDatabase(ctx, name)
	if err != nil {
		return nil, "", err
	}
	cfg := pool.Config()
	pool.Close()
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	if pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		return nil, "", err
	}
	if _, err := migrations.Up(ctx, pool, migrations.Options{Schema: schema}); err != nil {
		pool.Close()
		return nil, "", err
	}
	return pool, schema, nil
}

// walPosition is the server's current WAL position in bytes. WAL is the server's, not a
// database's: the difference over a round counts every system's writes, but the others are
// idle then (their idle polls write nothing).
func walPosition(ctx context.Context, pool *pgxpool.Pool) (int64, error) {
	var n int64
	err := pool.QueryRow(ctx, `SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint`).Scan(&n)
	return n, err
}

// commits reads the commit counter of pool's database (pg_stat_database.xact_commit: every
// committed transaction, read-only ones included).
func commits(ctx context.Context, pool *pgxpool.Pool) (int64, error) {
	var n int64
	err := pool.QueryRow(ctx, `SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()`).Scan(&n)
	return n, err
}

// completions records, per unit of work (a saga, an effect) numbered n, when it completed.
// A unit seen twice keeps its last time and counts once.
type completions struct {
	mu sync.Mutex
	at map[int]time.Time
	n  atomic.Int64
}

func newCompletions() *completions { return &completions{at: map[int]time.Time{}} }

func (c *completions) mark(n int) {
	now := time.Now()
	c.mu.Lock()
	if _, seen := c.at[n]; !seen {
		c.n.Add(1)
	}
	c.at[n] = now
	c.mu.Unlock()
}

// wait waits until want units completed.
func (c *completions) wait(ctx context.Context, want int, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for c.n.Load() < int64(want) {
		if time.Now().After(deadline) {
			return fmt.Errorf("%d of %d completed in %s", c.n.Load(), want, limit)
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		time.Sleep(time.Millisecond)
	}
	return nil
}

// latencies returns, for each n in started, its completion time minus its start time.
func (c *completions) latencies(started map[int]time.Time) []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]time.Duration, 0, len(started))
	for n, t0 := range started {
		if t1, ok := c.at[n]; ok {
			out = append(out, t1.Sub(t0))
		}
	}
	slices.Sort(out)
	return out
}

// runWriters runs fn(n) for n = first … first+total-1 from writers goroutines and returns how
// long they took.
func runWriters(writers, first, total int, fn func(n int) error) (time.Duration, error) {
	began := time.Now()
	var next atomic.Int64
	next.Store(int64(first) - 1)
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				n := int(next.Add(1))
				if n >= first+total {
					return
				}
				if err := fn(n); err != nil {
					errs <- fmt.Errorf("writer, unit %d: %w", n, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return time.Since(began), <-errs
}

// paced calls fn(n) for n = first … first+count-1 at rate per second, on a schedule (a slow
// call does not push back the ones after it), and returns each n's start time.
func paced(ctx context.Context, rate, first, count int, fn func(n int) error) (map[int]time.Time, error) {
	started := make(map[int]time.Time, count)
	begin := time.Now().Add(10 * time.Millisecond)
	for i := range count {
		time.Sleep(time.Until(begin.Add(time.Duration(i) * time.Second / time.Duration(rate))))
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		n := first + i
		started[n] = time.Now()
		if err := fn(n); err != nil {
			return nil, fmt.Errorf("unit %d: %w", n, err)
		}
	}
	return started, nil
}

// cpuMeter measures CPU time (user + system) of the bench process and, when the server is a
// local PostgreSQL this process can see in /proc, of the server's processes.
type cpuMeter struct {
	postmaster int // 0: server CPU unknown
}

func newCPUMeter(ctx context.Context, pool *pgxpool.Pool) *cpuMeter {
	var backend int
	if err := pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&backend); err != nil {
		return &cpuMeter{}
	}
	st, err := procStat(backend)
	if err != nil {
		return &cpuMeter{} // a remote server (DATABASE_URL elsewhere)
	}
	pm, err := procStat(st.ppid)
	if err != nil || !strings.HasPrefix(pm.comm, "postgres") {
		return &cpuMeter{}
	}
	return &cpuMeter{postmaster: st.ppid}
}

// cpuSample is CPU time used so far.
type cpuSample struct{ process, server time.Duration }

func (m *cpuMeter) sample() cpuSample {
	var s cpuSample
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err == nil {
		s.process = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	if m.postmaster == 0 {
		return s
	}
	// The postmaster's own time plus its reaped children's (cutime, cstime: backends that
	// exited), plus every live child's.
	if pm, err := procStat(m.postmaster); err == nil {
		s.server = pm.cpu + pm.children
	}
	entries, _ := os.ReadDir("/proc")
	for _, d := range entries {
		pid, err := strconv.Atoi(d.Name())
		if err != nil || pid == m.postmaster {
			continue
		}
		if st, err := procStat(pid); err == nil && st.ppid == m.postmaster {
			s.server += st.cpu
		}
	}
	return s
}

type procStatus struct {
	comm          string
	ppid          int
	cpu, children time.Duration
}

// procStat reads /proc/<pid>/stat: the command, parent pid, utime+stime and cutime+cstime.
func procStat(pid int) (procStatus, error) {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return procStatus{}, err
	}
	s := string(b)
	open, end := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if open < 0 || end < open {
		return procStatus{}, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	f := strings.Fields(s[end+1:]) // f[0] is the state (field 3)
	if len(f) < 15 {
		return procStatus{}, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	num := func(i int) int64 { v, _ := strconv.ParseInt(f[i], 10, 64); return v }
	const tick = time.Second / 100 // USER_HZ is 100 on Linux
	ppid, _ := strconv.Atoi(f[1])
	return procStatus{
		comm:     s[open+1 : end],
		ppid:     ppid,
		cpu:      time.Duration(num(11)+num(12)) * tick,
		children: time.Duration(num(13)+num(14)) * tick,
	}, nil
}

// peerSelected says whether a peer row runs system: all of them unless BENCH_PEERS lists
// some (comma-separated), for investigating one system without running the others.
func peerSelected(system string) bool {
	only := os.Getenv("BENCH_PEERS")
	return only == "" || slices.Contains(strings.Split(only, ","), system)
}

func envInt(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil && n > 0 {
		return n
	}
	return def
}

func envDuration(name string, def time.Duration) time.Duration {
	if d, err := time.ParseDuration(os.Getenv(name)); err == nil && d > 0 {
		return d
	}
	return def
}

// peerSystem is one system of a peer row, set up and ready to take units of work.
type peerSystem struct {
	name, what string
	// start runs one unit's business transaction (n is unique per system).
	start func(ctx context.Context, n int) error
	// enqueued, when set, is marked by start just before its COMMIT: latency starts there.
	// Otherwise latency starts when start is called.
	enqueued *completions
	done     *completions
	// check verifies, before stop, that want units each had their effects applied once.
	check func(ctx context.Context, want int) error
	stop  func() error
	meter *cpuMeter // optional
	// pool is on the system's own database: its commit counter is the system's.
	pool *pgxpool.Pool

	next                  int // the next unit's number
	units                 int // units in the throughput rounds
	busy, written         time.Duration
	cpuProcess, cpuServer time.Duration
	latency               []time.Duration
	commitsPerUnit        float64 // transactions committed in the system's database per unit
	walBytes              int64   // WAL the server wrote during the system's throughput rounds
}

// peerPlan shapes a peer row's harness.
type peerPlan struct {
	row                       string
	writers                   int
	rounds, perRound          int // throughput rounds per system, units per round
	latencyRounds, perLatency int // latency rounds per system, units per round
	rate                      int // units/s in the latency rounds
}

// runPeers measures every system with the same harness: a warm-up unit each, then
// throughput rounds — the writers start plan.perRound units and the round ends when the last
// completed — and latency rounds — one writer starts plan.perLatency units at plan.rate per
// second, then waits for them. Rounds alternate between the systems, in an order that rotates
// every round, so a neighbour's load on this shared machine falls on every system alike
// rather than on whichever ran during it. All systems stay up for the whole row (idle while
// another is measured). Then each system's effects are checked and it is stopped.
func runPeers(ctx context.Context, plan peerPlan, systems []*peerSystem) (err error) {
	defer func() {
		for _, s := range systems {
			if s.stop != nil {
				err = errors.Join(err, s.stop())
			}
		}
	}()
	for _, s := range systems {
		if err := s.start(ctx, 0); err != nil {
			return fmt.Errorf("%s: warm-up: %w", s.name, err)
		}
		if err := s.done.wait(ctx, 1, time.Minute); err != nil {
			return fmt.Errorf("%s: warm-up: %w", s.name, err)
		}
		s.next = 1
	}
	// Transactions per unit over the rounds (after the warm-up; read-only ones included: a
	// relay polling its claims counts). A backend reports its counts when
	// it goes idle, at most once a second: wait that long before each reading.
	time.Sleep(statsFlush)
	base := make([]int64, len(systems))
	for i, s := range systems {
		if base[i], err = commits(ctx, s.pool); err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
	}
	rotated := func(r int) []*peerSystem {
		out := make([]*peerSystem, 0, len(systems))
		for i := range systems {
			out = append(out, systems[(r+i)%len(systems)])
		}
		return out
	}
	for r := range plan.rounds {
		for _, s := range rotated(r) {
			var cpu0 cpuSample
			if s.meter != nil {
				cpu0 = s.meter.sample()
			}
			lsn0, err := walPosition(ctx, s.pool)
			if err != nil {
				return fmt.Errorf("%s: %w", s.name, err)
			}
			stopProfile := maybeProfile(fmt.Sprintf("%s-%s-round%d", plan.row, s.name, r))
			first, want := s.next, s.done.n.Load()+int64(plan.perRound)
			began := time.Now()
			written, err := runWriters(plan.writers, first, plan.perRound, func(n int) error { return s.start(ctx, n) })
			if err == nil {
				err = s.done.wait(ctx, int(want), 3*time.Minute)
			}
			took := time.Since(began)
			stopProfile()
			if err != nil {
				return fmt.Errorf("%s: round %d: %w", s.name, r, err)
			}
			lsn1, err := walPosition(ctx, s.pool)
			if err != nil {
				return fmt.Errorf("%s: %w", s.name, err)
			}
			s.walBytes += lsn1 - lsn0
			s.next += plan.perRound
			s.units += plan.perRound
			s.busy += took
			s.written += written
			if s.meter != nil {
				cpu1 := s.meter.sample()
				s.cpuProcess += cpu1.process - cpu0.process
				s.cpuServer += cpu1.server - cpu0.server
			}
		}
	}
	for r := range plan.latencyRounds {
		for _, s := range rotated(r) {
			first, want := s.next, s.done.n.Load()+int64(plan.perLatency)
			started, err := paced(ctx, plan.rate, first, plan.perLatency, func(n int) error { return s.start(ctx, n) })
			if err == nil {
				err = s.done.wait(ctx, int(want), time.Minute)
			}
			if err != nil {
				return fmt.Errorf("%s: latency round %d: %w", s.name, r, err)
			}
			s.next += plan.perLatency
			if s.enqueued != nil {
				s.enqueued.mu.Lock()
				for n := range started {
					started[n] = s.enqueued.at[n]
				}
				s.enqueued.mu.Unlock()
			}
			s.latency = append(s.latency, s.done.latencies(started)...)
		}
	}
	time.Sleep(statsFlush)
	for i, s := range systems {
		n, err := commits(ctx, s.pool)
		if err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
		s.commitsPerUnit = float64(n-base[i]) / float64(s.next-1)
	}
	for _, s := range systems {
		if err := s.check(ctx, s.next); err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
	}
	return nil
}

// statsFlush is how long PostgreSQL 15 may take to count an idle backend's transactions in
// pg_stat_database (PGSTAT_MIN_INTERVAL, 1 s), with a margin.
const statsFlush = 1500 * time.Millisecond

// rate is the system's throughput over its rounds, units/s.
func (s *peerSystem) rate() float64 { return float64(s.units) / s.busy.Seconds() }

// walPerUnit is the WAL written per unit in the throughput rounds, in KiB.
func (s *peerSystem) walPerUnit() float64 { return float64(s.walBytes) / 1024 / float64(s.units) }

// pollUntil runs q until it returns nil or limit passes (the last commits of a system may
// still be in flight when its completion was marked), and returns q's last error.
func pollUntil(ctx context.Context, limit time.Duration, q func() error) error {
	deadline := time.Now().Add(limit)
	for {
		err := q()
		if err == nil || time.Now().After(deadline) || ctx.Err() != nil {
			return err
		}
		time.Sleep(10 * time.Millisecond)
	}
}
