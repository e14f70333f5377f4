package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// relayChildEnv makes the bench binary run as a relay process (see relayChild): the relay's
// peak memory is measured in a process of its own, not in the bench's, which also holds the
// in-process Kafka and the consumer.
const relayChildEnv = "BENCH_RELAY_CHILD"

// relayChild runs a relay with the library's defaults (relay.Config and relaykafka.Config
// with only the connection settings filled in) until SIGTERM, then prints its peak resident
// set (VmHWM) on stdout.
func relayChild() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "relay child:", err); return 1 }
	pool, err := pgxpool.New(ctx, os.Getenv("BENCH_RELAY_DB"))
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: strings.Split(os.Getenv("BENCH_RELAY_BROKERS"), ",")})
	if err != nil {
		return fail(err)
	}
	defer func() { _ = sink.Close() }()
	cfg := relay.Config{Pool: pool, Sink: sink, Schema: os.Getenv("BENCH_RELAY_SCHEMA"),
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	if b := os.Getenv("BENCH_RELAY_MAX_BATCH_BYTES"); b != "" {
		if cfg.MaxBatchBytes, err = strconv.ParseInt(b, 10, 64); err != nil {
			return fail(err)
		}
	}
	r, err := relay.New(cfg)
	if err != nil {
		return fail(err)
	}
	if err := r.Run(ctx); err != nil {
		return fail(err)
	}
	hwm, err := peakRSS("self")
	if err != nil {
		return fail(err)
	}
	fmt.Printf("VmHWM %d\n", hwm)
	return 0
}

// peakRSS reads VmHWM (peak resident set, bytes) of a process from /proc.
func peakRSS(pid string) (int64, error) {
	f, err := os.Open("/proc/" + pid + "/status")
	if err != nil {
		return 0, err
	}
	defer func() { _ = f.Close() }()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb << 10, err
		}
	}
	return 0, fmt.Errorf("no VmHWM in /proc/%s/status", pid)
}

// benchRelayRSS: 2,000 rows of 900 KiB each (the limit is 1 MiB) drained by a relay process
// with the default configuration; its peak resident set is the figure. For comparison, the
// same with the byte budget lifted (what the relay did before it had one: 1,000 rows per batch
// whatever their size). The payloads compress well (lz4 in PostgreSQL, snappy on the wire) so
// the cluster and the in-process Kafka stay small; the relay holds them uncompressed either way.
func benchRelayRSS(ctx context.Context, e *env) ([]result, error) {
	var out []result
	for _, v := range []struct{ name, budget string }{{"onceflow", ""}, {"no-byte-budget", strconv.FormatInt(1<<40, 10)}} {
		mib, err := relayRSS(ctx, e, v.budget)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", v.name, err)
		}
		r := result{Scenario: "relay_rss", System: v.name, Value: mib, Unit: "MiB", Versus: "-"}
		if v.name == "onceflow" {
			r.Target = "≤ 512 MiB"
		} else {
			r.Versus = "before the budget"
		}
		out = append(out, r)
	}
	return out, nil
}

func relayRSS(ctx context.Context, e *env, budget string) (float64, error) {
	pool, schema, err := e.freshSchema(ctx, "rss")
	if err != nil {
		return 0, err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `ALTER TABLE `+pgsql.Table(schema, "outbox")+` ALTER COLUMN payload SET COMPRESSION lz4`); err != nil {
		return 0, fmt.Errorf("lz4 compression (PostgreSQL built without lz4?): %w", err)
	}
	topic := benchTopic("rss")
	// 32 bytes of md5 hex repeated: 900 KiB per row, distinct per row.
	payload := fmt.Sprintf(`convert_to(repeat(md5(i::text), %d), 'UTF8')`, rssPayload/32)
	if err := fillOutbox(ctx, pool, schema, topic, keysWhere(50, func(int) bool { return true }), rssRows, payload); err != nil {
		return 0, err
	}
	rcv, err := newReceiver(ctx, e.brokers, topic)
	if err != nil {
		return 0, err
	}
	defer rcv.stop()
	self, err := os.Executable()
	if err != nil {
		return 0, err
	}
	cmd := exec.CommandContext(ctx, self)
	cmd.Env = append(os.Environ(), relayChildEnv+"=1", "BENCH_RELAY_DB="+e.pgURL, "BENCH_RELAY_SCHEMA="+schema,
		"BENCH_RELAY_BROKERS="+strings.Join(e.brokers, ","), "BENCH_RELAY_MAX_BATCH_BYTES="+budget)
	var stdout bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, os.Stderr
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	waited := false
	defer func() {
		if !waited {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}()
	if err := rcv.waitFor(ctx, rssRows, 10*time.Minute); err != nil {
		return 0, err
	}
	took := time.Since(start)
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		return 0, err
	}
	waited = true
	if err := cmd.Wait(); err != nil {
		return 0, fmt.Errorf("relay child: %w", err)
	}
	var hwm int64
	if _, err := fmt.Sscanf(stdout.String(), "VmHWM %d", &hwm); err != nil {
		return 0, fmt.Errorf("relay child output %q: %w", stdout.String(), err)
	}
	mib := float64(hwm) / (1 << 20)
	fmt.Fprintf(os.Stderr, "  relay_rss budget=%q: %d rows of %d KiB in %s, relay peak RSS %.0f MiB\n", budget, rssRows, rssPayload>>10, took.Round(time.Millisecond), mib)
	return mib, nil
}
