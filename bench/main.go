// Command bench measures onceflow against the plain-Watermill way of doing the same work, side
// by side in one run on the same embedded PostgreSQL and in-process Kafka (kfake), so the
// ratios are comparable even on a noisy machine. `make bench` runs it; `-only` picks scenarios.
//
// It is a module of its own (bench/go.mod, replacing the library with ../), so the baselines'
// dependencies — watermill-sql and its lib/pq — never reach the go.mod of a library user.
//
// Output: a table per scenario with the ratio to the baseline, and one machine-readable line
// per figure: BENCH <scenario> <system> <value> <unit>.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"runtime"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/embedded"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/migrations"
)

// result is one measured figure.
type result struct {
	Scenario string
	System   string // "onceflow" or the baseline's name
	Value    float64
	Unit     string
	// HigherIsBetter decides the direction of the ratio in the table.
	HigherIsBetter bool
	// Target is the goal for this figure in words ("≥ 10× forwarder"), shown in the table.
	Target string
	// Versus, when set, is shown in the VS BASELINE column instead of the computed ratio.
	Versus string
}

// env is the shared infrastructure every scenario runs on.
type env struct {
	pgURL   string   // superuser URL of the embedded (or DATABASE_URL) server
	brokers []string // kfake (or KAFKA_BROKERS)
	kafka   *embedded.Kafka
	log     *slog.Logger
	n       int // schema counter
	// schemas created by freshSchema since the last cleanUp.
	schemas []string
}

// freshSchema creates a migrated schema of its own for a scenario and a pool bound to it.
func (e *env) freshSchema(ctx context.Context, name string) (*pgxpool.Pool, string, error) {
	e.n++
	schema := fmt.Sprintf("bench_%s_%d", name, e.n)
	e.schemas = append(e.schemas, schema)
	cfg, err := pgxpool.ParseConfig(e.pgURL)
	if err != nil {
		return nil, "", err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = 32
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, "", err
	}
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgsql.Ident(schema)+" CASCADE"); err != nil {
		pool.Close()
		return nil, "", err
	}
	if _, err := migrations.Up(ctx, pool, migrations.Options{Schema: schema}); err != nil {
		pool.Close()
		return nil, "", err
	}
	return pool, schema, nil
}

// scenario is one named measurement; it returns a figure per system.
type scenario struct {
	name string
	run  func(ctx context.Context, e *env) ([]result, error)
}

// scenarios lists every benchmark in the order they run and print.
var scenarios = []scenario{
	{"outbox_write", benchOutboxWrite},
	{"write_concurrent", benchWriteConcurrent},
	{"drain", benchDrain},
	{"drain_growth", benchDrainGrowth},
	{"late_lookup", benchLateLookup},
	{"drain_churn", benchDrainChurn},
	{"drain_held_snapshot", benchDrainHeldSnapshot},
	{"drain_held_lock", benchDrainHeldLock},
	{"relay_skip", benchRelaySkip},
	{"relay_rss", benchRelayRSS},
	{"latency", benchLatency},
	{"latency_load", benchLatencyLoad},
	{"stall", benchStall},
	{"scheduled_backlog", benchScheduledBacklog},
	{"scheduled_latency", benchScheduledLatency},
	{"scheduled_burst", benchScheduledBurst},
	{"inbox", benchInbox},
	{"inbox_batch", benchInboxBatch},
	{"inbox_batch_latency", benchInboxBatchLatency},
	{"inbox_cleanup", benchInboxCleanup},
	{"http", benchHTTP},
	{"saga", benchSaga},
	{"saga_local", benchSagaLocal},
	{"saga_hot", benchSagaHot},
	{"saga_vs_dbos", benchSagaVsDBOS},
	{"effect_vs_river", benchEffectVsRiver},
	{"stats", benchStats},
	{"console", benchConsole},
	{"tracing", benchTracing},
}

func main() {
	if os.Getenv(relayChildEnv) != "" {
		os.Exit(relayChild())
	}
	only := flag.String("only", "", "comma-separated scenario names to run (default: all)")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, *only); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, only string) error {
	began := time.Now()
	e := &env{log: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	e.pgURL = os.Getenv("DATABASE_URL")
	if e.pgURL == "" {
		// Production-like durability (fsync and synchronous_commit on) so commit costs are real.
		pg, err := embedded.StartPostgres(ctx, embedded.PostgresOptions{Durable: true})
		if err != nil {
			return err
		}
		defer stopPostgres(pg)
		e.pgURL = pg.URL()
	}
	if b := os.Getenv("KAFKA_BROKERS"); b != "" {
		e.brokers = strings.Split(b, ",")
	} else {
		k, err := embedded.StartKafka(1)
		if err != nil {
			return err
		}
		defer k.Stop()
		e.kafka, e.brokers = k, k.Brokers()
	}
	fmt.Printf("onceflow bench — %s, %d CPUs, %s/%s, %s\n\n", time.Now().UTC().Format("2006-01-02 15:04 UTC"), runtime.NumCPU(), runtime.GOOS, runtime.GOARCH, runtime.Version())
	var all []result
	for _, s := range scenarios {
		if only != "" && !slices.Contains(strings.Split(only, ","), s.name) {
			continue
		}
		fmt.Fprintf(os.Stderr, "running %s ...\n", s.name)
		t0 := time.Now()
		rs, err := s.run(ctx, e)
		if err != nil {
			return fmt.Errorf("scenario %s: %w", s.name, err)
		}
		fmt.Fprintf(os.Stderr, "  %s took %s\n", s.name, time.Since(t0).Round(100*time.Millisecond))
		if os.Getenv("BENCH_KEEP") == "" {
			e.cleanUp(ctx)
		}
		all = append(all, rs...)
	}
	printTable(all)
	fmt.Printf("\ntotal %s\n", time.Since(began).Round(time.Second))
	return nil
}

func stopPostgres(pg *embedded.Postgres) {
	if err := pg.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, "bench: stop embedded postgres:", err)
	}
}

func printTable(rs []result) {
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SCENARIO\tSYSTEM\tVALUE\tUNIT\tVS BASELINE\tTARGET")
	for _, r := range rs {
		ratio := "-"
		if r.Versus != "" {
			ratio = r.Versus
		} else if r.System != "onceflow" {
			ratio = "baseline"
		} else if base, ok := baseline(rs, r.Scenario); ok && base.Value > 0 && r.Value > 0 {
			if r.HigherIsBetter {
				ratio = fmt.Sprintf("%.2f× %s", r.Value/base.Value, base.System)
			} else {
				ratio = fmt.Sprintf("%.2f× lower than %s", base.Value/r.Value, base.System)
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", r.Scenario, r.System, formatValue(r.Value), r.Unit, ratio, r.Target)
	}
	tw.Flush()
	fmt.Println()
	for _, r := range rs {
		fmt.Printf("BENCH %s %s %s %s\n", r.Scenario, r.System, formatValue(r.Value), r.Unit)
	}
}

// baseline is the first non-onceflow figure of a scenario.
func baseline(rs []result, scenario string) (result, bool) {
	for _, r := range rs {
		if r.Scenario == scenario && r.System != "onceflow" {
			return r, true
		}
	}
	return result{}, false
}

func formatValue(v float64) string {
	switch {
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.1f", v)
	default:
		return fmt.Sprintf("%.2f", v)
	}
}

// cleanUp runs after each scenario, on one connection, so that no scenario pays for an
// earlier one's leftovers. BENCH_KEEP=1 skips it (to inspect the schemas after a run).
//
// It drops the schemas the scenario created. Left in place, their dead rows (a drained
// million-row outbox, the held-snapshot scenarios' hundreds of thousands) keep autovacuum busy
// during the scenarios after them, on the same two cores. Measured with the relay scenarios
// before latency_load (-only=drain_growth,…,relay_rss,latency_load): kept, a vacuum of their
// outboxes ran in 80 of latency_load's 203 samples and its p99 was 15.3 ms; dropped, none ran
// and it was 5.4 ms.
//
// Then it runs CHECKPOINT, which writes what the scenario left dirty in shared_buffers. Left to
// the server, the checkpoint that the relay scenarios' WAL requests is spread over the next
// minutes: in the 11:53 full run of docs/PERFORMANCE.md (issue 24's fifth session) it was being
// written in every sample of latency_load, whose backends also wrote 483 buffers of that data
// themselves (evicting a dirty page means writing it first), and drain_growth's first drain
// paid for the pages `drain` left, which raised its ratios. With the checkpoint: none and 0.
// (latency_load's p99 difference was within the machine's noise in two pairs.)
func (e *env) cleanUp(ctx context.Context) {
	conn, err := pgx.Connect(ctx, e.pgURL)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench: clean up after the scenario:", err)
		return
	}
	defer func() { _ = conn.Close(ctx) }()
	for _, s := range e.schemas {
		if _, err := conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgsql.Ident(s)+" CASCADE"); err != nil {
			fmt.Fprintln(os.Stderr, "bench: drop schema:", err)
		}
	}
	e.schemas = nil
	if _, err := conn.Exec(ctx, "CHECKPOINT"); err != nil {
		fmt.Fprintln(os.Stderr, "bench: checkpoint:", err)
	}
}
