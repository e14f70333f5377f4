// Package platform is the plumbing the example services share, kept out of their main.go so
// that what is left there is the onceflow part a reader copies: where PostgreSQL and Kafka are,
// the pool on a service's own schema, topics, Kafka subscribers, an in-process relay and the
// HTTP server.
package platform

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/migrations"
)

// Flags are the command-line flags every example service takes.
type Flags struct {
	// Addr is the HTTP address: the service's API (if any), /healthz and /debug/counters.
	Addr string
	// Schema is the service's own PostgreSQL schema: its business tables and onceflow's.
	Schema string
	// Relay runs the outbox relay inside the service. Production runs `onceflow relay`
	// beside it instead (as `make demo` does, with -relay=false).
	Relay bool
	// TopicPrefix is put before every topic and consumer group name, so that runs sharing a
	// real Kafka cluster do not read each other's messages.
	TopicPrefix string
	// Instance is this process's static consumer-group membership id (KIP-345): a restarted
	// process with the same id takes its partitions back at once instead of waiting for the
	// broker to time its old session out. Unique per running instance; default the host name.
	Instance string
	// LogLevel is debug, info, warn or error.
	LogLevel string
}

// RegisterFlags defines the common flags on the default flag set.
func RegisterFlags(defaultAddr, defaultSchema string) *Flags {
	host, _ := os.Hostname()
	f := &Flags{}
	flag.StringVar(&f.Addr, "addr", defaultAddr, "HTTP address (API, /healthz, /debug/counters)")
	flag.StringVar(&f.Schema, "schema", defaultSchema, "PostgreSQL schema of this service (created and migrated at start)")
	flag.BoolVar(&f.Relay, "relay", true, "run the outbox relay in this process; false when `onceflow relay` runs beside it")
	flag.StringVar(&f.TopicPrefix, "topic-prefix", "", "prefix for every topic and consumer group")
	flag.StringVar(&f.Instance, "instance", host, "static consumer-group member id of this process (unique per instance)")
	flag.StringVar(&f.LogLevel, "log-level", "info", "debug, info, warn or error")
	return f
}

// Main parses the command line (register the service's own flags before calling it), then
// runs run until SIGTERM or Ctrl-C with the flags' logger (also made slog's default, so
// handlers that log through slog use it), and exits 1 with the error when run fails.
func Main(service string, f *Flags, run func(ctx context.Context, log *slog.Logger) error) {
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	log, err := f.Logger(service)
	if err == nil {
		slog.SetDefault(log)
		err = run(ctx, log)
	}
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, service+":", err)
		os.Exit(1)
	}
}

// Logger returns a text logger on stderr at the flags' level, naming the service.
func (f *Flags) Logger(service string) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(f.LogLevel)); err != nil {
		return nil, fmt.Errorf("-log-level %q: use debug, info, warn or error", f.LogLevel)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})).With("service", service), nil
}

// Infra is where the service finds PostgreSQL and Kafka.
type Infra struct {
	DatabaseURL string
	Brokers     []string
	embedded    *Embedded
}

// StartInfra uses DATABASE_URL and KAFKA_BROKERS when they are set; otherwise it starts an
// embedded PostgreSQL and an in-process Kafka (kfake) and says so. Close stops what it started.
func StartInfra(ctx context.Context, log *slog.Logger) (*Infra, error) {
	e, err := StartEmbedded(ctx)
	if err != nil {
		return nil, err
	}
	if e.StartedDB {
		log.Info("DATABASE_URL is unset: started a throwaway PostgreSQL (removed on exit)")
	}
	if e.StartedKafka {
		log.Info("KAFKA_BROKERS is unset: started an in-process Kafka (kfake)", "brokers", strings.Join(e.Brokers, ","))
	}
	return &Infra{DatabaseURL: e.DatabaseURL, Brokers: e.Brokers, embedded: e}, nil
}

// Close stops the embedded servers.
func (in *Infra) Close() { in.embedded.Stop() }

// OpenSchema applies onceflow's migrations to schema, then the service's own DDL (idempotent:
// CREATE ... IF NOT EXISTS), and returns a pool whose search_path is that schema, so the
// service's SQL names its tables without a schema. maxConns bounds the pool; size it for the
// messages handled at once plus the HTTP requests in flight (see docs/inbox.md, "Pool sizing").
func OpenSchema(ctx context.Context, url, schema, ddl string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL: %w", err)
	}
	cfg.MaxConns = maxConns
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if _, err := migrations.Up(ctx, pool, migrations.Options{Schema: schema}); err != nil {
		pool.Close()
		return nil, fmt.Errorf("migrate schema %s: %w", schema, err)
	}
	if ddl != "" {
		if _, err := pool.Exec(ctx, ddl); err != nil {
			pool.Close()
			return nil, fmt.Errorf("create the tables of schema %s: %w", schema, err)
		}
	}
	return pool, nil
}
