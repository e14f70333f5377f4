package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
	"github.com/onceflow/onceflow/relay/relayprom"
)

const relaySynopsis = `relay [flags]

Publishes the outbox to Kafka: claims committed rows in id order, sends each batch through an
idempotent producer, deletes exactly the rows Kafka acknowledged. Run several for availability:
they share the work through shard leases in Postgres and take over a dead relay's shards within
--lease-duration × 1.25. SIGTERM or SIGINT finishes the batch in flight (up to
--shutdown-timeout), releases the leases and exits 0. The schema must be migrated first
(onceflow migrate up). See docs/relay.md.`

// envParser reads typed defaults from the environment and remembers every bad value, so the
// command reports them all at once.
type envParser struct {
	getenv   func(string) string
	problems []string
}

func (p *envParser) int(name string, def int) int {
	v := p.getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		p.problems = append(p.problems, fmt.Sprintf("%s=%q is not a whole number", name, v))
		return def
	}
	return n
}

func (p *envParser) duration(name string, def time.Duration) time.Duration {
	v := p.getenv(name)
	if v == "" {
		return def
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		p.problems = append(p.problems, fmt.Sprintf("%s=%q is not a duration (e.g. 500ms, 2s, 1m)", name, v))
		return def
	}
	return d
}

func (p *envParser) bool(name string, def bool) bool {
	v := p.getenv(name)
	if v == "" {
		return def
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		p.problems = append(p.problems, fmt.Sprintf("%s=%q is not true or false", name, v))
		return def
	}
	return b
}

func (c *cli) runRelay(ctx context.Context, args []string) error {
	fs := c.newFlagSet("relay", relaySynopsis)
	db := c.addDBFlags(fs)
	env := envParser{getenv: c.getenv}
	kafka := c.addKafkaFlags(fs, &env, relaykafka.DefaultClientID)
	listenURL := c.getenv("ONCEFLOW_LISTEN_DATABASE_URL")
	c.secrets.add(listenURL) // masked in everything the command writes, as DATABASE_URL is
	fs.Var(&dsnValue{s: &listenURL, secrets: c.secrets, warn: c.stderr, flag: "--listen-database-url", env: "ONCEFLOW_LISTEN_DATABASE_URL"}, "listen-database-url",
		"connection `string` for the relay's LISTEN connection, when --database-url goes through a pooler in transaction mode "+
			"(PgBouncer): the primary directly or a session-mode pool (default: --database-url) [ONCEFLOW_LISTEN_DATABASE_URL]")
	var (
		compression     = fs.String("kafka-compression", c.envOr("ONCEFLOW_KAFKA_COMPRESSION", relaykafka.DefaultCompression), "codec of record batches: none, gzip, snappy, lz4 or zstd; every consumer must decode it [ONCEFLOW_KAFKA_COMPRESSION]")
		batchSize       = fs.Int("batch-size", env.int("ONCEFLOW_RELAY_BATCH_SIZE", relay.DefaultBatchSize), "most rows claimed and sent to Kafka per round trip [ONCEFLOW_RELAY_BATCH_SIZE]")
		maxBatchBytes   = fs.Int64("max-batch-bytes", int64(env.int("ONCEFLOW_RELAY_MAX_BATCH_BYTES", relay.DefaultMaxBatchBytes)), "most payload, key and metadata bytes claimed in one batch; bounds the relay's memory (about twice this plus ~50 MiB) [ONCEFLOW_RELAY_MAX_BATCH_BYTES]")
		pollInterval    = fs.Duration("poll-interval", env.duration("ONCEFLOW_RELAY_POLL_INTERVAL", relay.DefaultPollInterval), "longest an idle (sleeping) relay waits before looking for rows when no NOTIFY arrived [ONCEFLOW_RELAY_POLL_INTERVAL]")
		busyPoll        = fs.Duration("busy-poll-interval", env.duration("ONCEFLOW_RELAY_BUSY_POLL_INTERVAL", relay.DefaultBusyPoll), "how often a relay claims while rows keep arriving (bounds their wait without NOTIFY; lets batches grow under load) [ONCEFLOW_RELAY_BUSY_POLL_INTERVAL]")
		shards          = fs.Int("shards", env.int("ONCEFLOW_RELAY_SHARDS", relay.DefaultShards), "virtual shards (must be the same for every relay of the schema; see --reshard) [ONCEFLOW_RELAY_SHARDS]")
		leaseDuration   = fs.Duration("lease-duration", env.duration("ONCEFLOW_RELAY_LEASE_DURATION", relay.DefaultLeaseDuration), "shard lease length; a dead relay's shards move within 1.25× this [ONCEFLOW_RELAY_LEASE_DURATION]")
		maxAttempts     = fs.Int("max-attempts", env.int("ONCEFLOW_RELAY_MAX_ATTEMPTS", relay.DefaultMaxAttempts), "refusals the broker repeats every time (e.g. message too large) before a row is parked; transient errors never count [ONCEFLOW_RELAY_MAX_ATTEMPTS]")
		maxMessageBytes = fs.Int("max-message-bytes", env.int("ONCEFLOW_RELAY_MAX_MESSAGE_BYTES", relaykafka.DefaultMaxMessageBytes), "largest record sent; larger rows are refused before sending (keep ≤ the topic's max.message.bytes) [ONCEFLOW_RELAY_MAX_MESSAGE_BYTES]")
		instanceID      = fs.String("id", c.getenv("ONCEFLOW_RELAY_ID"), "unique name of this relay in the lease table; a restart with the same id takes its leases back at once (default <hostname>-<pid>) [ONCEFLOW_RELAY_ID]")
		stmtTimeout     = fs.Duration("statement-timeout", env.duration("ONCEFLOW_RELAY_STATEMENT_TIMEOUT", relay.DefaultStatementTimeout), "longest a claim, delete or failure record may take before it is cancelled and retried on a fresh connection [ONCEFLOW_RELAY_STATEMENT_TIMEOUT]")
		shutdownTimeout = fs.Duration("shutdown-timeout", env.duration("ONCEFLOW_RELAY_SHUTDOWN_TIMEOUT", relay.DefaultShutdownTimeout), "on SIGTERM, how long the batch in flight may take before it is abandoned (its rows stay) [ONCEFLOW_RELAY_SHUTDOWN_TIMEOUT]")
		metricsAddr     = fs.String("metrics-addr", c.getenv("ONCEFLOW_METRICS_ADDR"), "serve Prometheus /metrics and /healthz on this address, e.g. :9464 (default: off) [ONCEFLOW_METRICS_ADDR]")
		logLevel        = fs.String("log-level", c.envOr("ONCEFLOW_LOG_LEVEL", "info"), "debug, info, warn or error [ONCEFLOW_LOG_LEVEL]")
		logFormat       = fs.String("log-format", c.envOr("ONCEFLOW_LOG_FORMAT", "text"), "text or json [ONCEFLOW_LOG_FORMAT]")
		noListen        = fs.Bool("no-listen", env.bool("ONCEFLOW_RELAY_NO_LISTEN", false), "no LISTEN connection: poll only (idle rows wait up to --poll-interval); behind a transaction-mode pooler without --listen-database-url [ONCEFLOW_RELAY_NO_LISTEN]")
		reshard         = fs.Bool("reshard", env.bool("ONCEFLOW_RELAY_RESHARD", false), "before starting, change the lease table to --shards (refused while any relay of the schema runs) [ONCEFLOW_RELAY_RESHARD]")
	)
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q: the relay takes flags only (see onceflow relay -h)", fs.Args())
	}

	problems := env.problems
	if err := db.validate(); err != nil {
		problems = append(problems, err.Error())
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(*logLevel)); err != nil {
		problems = append(problems, fmt.Sprintf("--log-level %q: use debug, info, warn or error", *logLevel))
	}
	if *logFormat != "text" && *logFormat != "json" {
		problems = append(problems, fmt.Sprintf("--log-format %q: use text or json", *logFormat))
	}
	kcfg, kproblems := kafka.config()
	problems = append(problems, kproblems...)
	hopts := &slog.HandlerOptions{Level: level}
	var logger *slog.Logger
	if *logFormat == "json" {
		logger = slog.New(slog.NewJSONHandler(c.stderr, hopts))
	} else {
		logger = slog.New(slog.NewTextHandler(c.stderr, hopts))
	}
	var metrics *relayprom.Metrics
	reg := prometheus.NewRegistry()
	if *metricsAddr != "" {
		reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
		m, err := relayprom.New(reg)
		if err != nil {
			return fmt.Errorf("relay metrics: %w", err)
		}
		metrics = m
	}
	cfg := relay.Config{
		Schema:           db.schema,
		BatchSize:        *batchSize,
		PollInterval:     *pollInterval,
		MaxBatchBytes:    *maxBatchBytes,
		StatementTimeout: *stmtTimeout,
		BusyPollInterval: *busyPoll,
		Shards:           *shards,
		LeaseDuration:    *leaseDuration,
		MaxAttempts:      *maxAttempts,
		ShutdownTimeout:  *shutdownTimeout,
		InstanceID:       *instanceID,
		DisableListen:    *noListen,
		Logger:           logger,
	}
	if listenURL != "" {
		lcfg, err := pgx.ParseConfig(listenURL)
		switch {
		case err != nil:
			problems = append(problems, pgsql.RedactError(fmt.Errorf("--listen-database-url: %w", err), listenURL).Error())
		case *noListen:
			problems = append(problems, "--listen-database-url and --no-listen together: the relay either listens on that connection or does not listen; drop one")
		default:
			if lcfg.RuntimeParams["application_name"] == "" {
				lcfg.RuntimeParams["application_name"] = "onceflow-relay-listen"
			}
			cfg.ListenConnConfig = lcfg
		}
	}
	if metrics != nil {
		cfg.Metrics = metrics
	}
	kcfg.MaxMessageBytes, kcfg.Compression = *maxMessageBytes, *compression
	kcfg.Logger = logger // the topics' durability warnings (replication factor, min.insync.replicas)
	// Validate both configurations now, without connecting, so every mistake is reported at once.
	problems = appendProblems(problems, cfg.Validate())
	sink, err := relaykafka.NewSink(kcfg)
	problems = appendProblems(problems, err)
	if len(problems) > 0 {
		if sink != nil {
			_ = sink.Close() // nothing connected yet
		}
		return fmt.Errorf("invalid settings:\n  - %s", strings.Join(problems, "\n  - "))
	}
	defer func() { _ = sink.Close() }()
	if kafka.plainWithoutTLS() {
		logger.Warn(plainWithoutTLSWarning)
	}

	// No ping: Run waits for the database (with /healthz unhealthy) when it is not up yet.
	pool, err := db.open(ctx, "onceflow-relay")
	if err != nil {
		return err
	}
	defer pool.Close()
	if *reshard {
		if err := relay.Reshard(ctx, pool, relay.ReshardOptions{Schema: db.schema, Shards: *shards}); err != nil {
			return err
		}
		logger.Info("lease table resharded", "schema", db.schema, "shards", *shards)
	}
	cfg.Pool, cfg.Sink = pool, sink
	r, err := relay.New(cfg)
	if err != nil {
		return err
	}
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	if err := sink.Ping(pctx); err != nil {
		// The error says what to check: brokers, TLS or SASL settings.
		logger.Warn("Kafka does not answer yet; rows stay in the outbox until it does", "brokers", kcfg.Brokers, "err", err)
	}
	cancel()

	if *metricsAddr != "" {
		srv, err := serveMetrics(*metricsAddr, reg, r, logger)
		if err != nil {
			return err
		}
		defer func() {
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = srv.Shutdown(sctx)
		}()
	}
	return r.Run(ctx)
}

// appendProblems adds err to the list, one entry per problem of a relay.ConfigError (which
// relaykafka.NewSink returns too).
func appendProblems(problems []string, err error) []string {
	var ce *relay.ConfigError
	if errors.As(err, &ce) {
		for _, p := range ce.Problems {
			problems = append(problems, p.Error())
		}
		return problems
	}
	if err != nil {
		problems = append(problems, err.Error())
	}
	return problems
}

// serveMetrics serves /metrics and /healthz; it fails at once if the address is taken.
func serveMetrics(addr string, reg *prometheus.Registry, r *relay.Relay, logger *slog.Logger) (*http.Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--metrics-addr %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		if err := r.Health(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		_, _ = io.WriteString(w, "ok\n") // the client went away if this fails
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error("metrics server stopped", "err", err)
		}
	}()
	logger.Info("serving metrics", "addr", ln.Addr().String(), "paths", "/metrics /healthz")
	return srv, nil
}
