package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/pgsql"
	cleaning "github.com/onceflow/onceflow/internal/retention"
	"github.com/onceflow/onceflow/retention"
	"github.com/onceflow/onceflow/saga"
)

// cleaner is one table `onceflow cleanup` keeps bounded. Add a line to cleaners for another
// table; each runs in list order with the shared options.
type cleaner struct {
	name    string // the table, and the value --only accepts
	summary string
	clean   func(ctx context.Context, pool *pgxpool.Pool, o cleanupOptions) (int64, error)
	// expired counts, for --dry-run, the rows clean would delete now, up to max: the owning
	// package's admin, on the table's age index as the cleaner's own statements are.
	expired func(ctx context.Context, pool *pgxpool.Pool, o cleanupOptions, max int64) (int64, error)
}

// cleanupOptions are the flags every cleaner receives.
type cleanupOptions struct {
	schema     string
	window     time.Duration
	allowShort bool
	batchSize  int
	logger     *slog.Logger
	// sagas, when set, is the orchestrator's database (--saga-database-url): the inbox
	// cleaner asks it which barrier rows' sagas are alive instead of this schema's saga table.
	sagas *sagaSource
}

// sagaSource is the database and schema of the orchestrator whose sagas the participant's
// barrier rows belong to.
type sagaSource struct {
	pool  *pgxpool.Pool
	admin *saga.Admin
}

var cleaners = []cleaner{
	// A barrier row of a live saga is kept however old (see inbox.CleanerConfig.Sagas).
	{"processed_event", "inbox dedup rows older than --window (a live saga's barrier rows stay)", cleanProcessedEvents,
		func(ctx context.Context, pool *pgxpool.Pool, o cleanupOptions, max int64) (int64, error) {
			a, err := inbox.NewAdmin(o.schema)
			if err != nil {
				return 0, err
			}
			return a.Expired(ctx, pool, o.window, max, o.sagas != nil)
		}},
	{"idempotency_record", "HTTP idempotency records past their expiry (set by the middleware's Window)", cleanIdempotencyRecords,
		func(ctx context.Context, pool *pgxpool.Pool, o cleanupOptions, max int64) (int64, error) {
			a, err := idempotency.NewAdmin(o.schema)
			if err != nil {
				return 0, err
			}
			return a.Expired(ctx, pool, max)
		}},
	{"saga", "sagas that finished (completed or compensated) longer than --window ago", cleanSagas,
		func(ctx context.Context, pool *pgxpool.Pool, o cleanupOptions, max int64) (int64, error) {
			a, err := saga.NewAdmin(o.schema)
			if err != nil {
				return 0, err
			}
			return a.Expired(ctx, pool, o.window, max)
		}},
}

// dryRunCap bounds cleanup --dry-run's count per table: counting stops there ("1000000 or
// more"), so a dry run over a neglected table takes a second, not minutes.
const dryRunCap = 1_000_000

// dryRun prints how many rows each selected cleaner would delete now, and deletes nothing.
// With o.sagas (--saga-database-url), processed_event's count leaves barrier rows out: which
// of them go is asked of the orchestrator's database during the cleanup itself.
func dryRun(ctx context.Context, pool *pgxpool.Pool, p *printer, o cleanupOptions, selected []cleaner) error {
	for _, c := range selected {
		n, err := c.expired(ctx, pool, o, dryRunCap)
		if err != nil {
			return fmt.Errorf("%s: count expired rows: %w", c.name, err)
		}
		more, note := "", ""
		if n >= dryRunCap {
			more = " or more"
		}
		if c.name == "processed_event" && o.sagas != nil {
			note = "; expired barrier rows not counted: those of sagas that finished go too, asked of --saga-database-url"
		}
		p.f("%s: %d%s expired rows would be deleted (dry run: nothing deleted)%s\n", c.name, n, more, note)
	}
	return p.err
}

func cleanSagas(ctx context.Context, pool *pgxpool.Pool, o cleanupOptions) (int64, error) {
	c, err := saga.NewCleaner(saga.CleanerConfig{
		Pool: pool, Schema: o.schema, Window: o.window, AllowShortWindow: o.allowShort, BatchSize: o.batchSize, Logger: o.logger,
	})
	if err != nil {
		return 0, err
	}
	return c.Clean(ctx)
}

func cleanIdempotencyRecords(ctx context.Context, pool *pgxpool.Pool, o cleanupOptions) (int64, error) {
	c, err := idempotency.NewCleaner(idempotency.CleanerConfig{Pool: pool, Schema: o.schema, BatchSize: o.batchSize, Logger: o.logger})
	if err != nil {
		return 0, err
	}
	return c.Clean(ctx)
}

func cleanProcessedEvents(ctx context.Context, pool *pgxpool.Pool, o cleanupOptions) (int64, error) {
	cfg := inbox.CleanerConfig{
		Pool: pool, Schema: o.schema, Window: o.window, AllowShortWindow: o.allowShort, BatchSize: o.batchSize, Logger: o.logger,
	}
	if o.sagas != nil {
		cfg.Sagas = func(ctx context.Context, ids []string) ([]string, error) {
			return o.sagas.admin.Alive(ctx, o.sagas.pool, ids)
		}
	}
	c, err := inbox.NewCleaner(cfg)
	if err != nil {
		return 0, err
	}
	return c.Clean(ctx)
}

func (c *cli) runCleanup(ctx context.Context, args []string) error {
	names := make([]string, len(cleaners))
	var list strings.Builder
	for i, c := range cleaners {
		names[i] = c.name
		fmt.Fprintf(&list, "\n  %-18s %s", c.name, c.summary)
	}
	fs := c.newFlagSet("cleanup", "cleanup [flags]\n\n"+
		"Deletes expired rows in batches that skip locked rows, so writers are never blocked.\n"+
		"Runs once by default; with --every or --daily-at it keeps running until SIGTERM.\n\nTables:"+list.String())
	db := c.addDBFlags(fs)
	windowDefault := strings.TrimSuffix(inbox.DefaultWindow.String(), "0m0s") // "72h"
	windowText := fs.String("window", c.envOr("ONCEFLOW_RETENTION_WINDOW", windowDefault),
		"keep rows younger than this; must exceed the longest redelivery horizon [ONCEFLOW_RETENTION_WINDOW]")
	allowShort := fs.Bool("allow-short-window", false, "accept a window under 24h (records deleted too early let late redeliveries run again)")
	batchSize := fs.Int("batch-size", retention.DefaultBatchSize, "rows deleted (and locked) per statement")
	only := fs.String("only", "", "comma-separated tables to clean (default: all): "+strings.Join(names, ", "))
	every := fs.Duration("every", 0, "keep running and clean at this interval, e.g. 1h")
	dailyAt := fs.String("daily-at", "", "keep running and clean once a day at this UTC time, e.g. 03:00")
	dry := fs.Bool("dry-run", false, "count the rows each table would lose now, and delete nothing")
	sagaDB := &dbFlags{c: c, url: c.getenv("ONCEFLOW_SAGA_DATABASE_URL")}
	c.secrets.add(sagaDB.url) // masked in everything the command writes, as DATABASE_URL is
	fs.Var(&dsnValue{s: &sagaDB.url, secrets: c.secrets, warn: c.stderr, flag: "--saga-database-url", env: "ONCEFLOW_SAGA_DATABASE_URL"}, "saga-database-url",
		"the saga orchestrator's database, when it is not this one: processed_event keeps the barrier rows of its sagas that are not finished "+
			"(default: this schema's saga table) [ONCEFLOW_SAGA_DATABASE_URL]")
	fs.StringVar(&sagaDB.schema, "saga-schema", "", "the onceflow schema in --saga-database-url (default: --schema)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(c.stderr, "onceflow cleanup: unexpected arguments %q\n", fs.Args())
		fs.Usage()
		return errUsage
	}

	// Validate everything before connecting: bad input changes nothing.
	var problems []error
	window, err := time.ParseDuration(*windowText)
	if err != nil {
		problems = append(problems, fmt.Errorf("--window %q is not a duration (e.g. 72h)", *windowText))
	} else if err := cleaning.CheckWindow("--window", window, *allowShort, "--allow-short-window"); err != nil {
		problems = append(problems, err)
	}
	if *batchSize <= 0 {
		problems = append(problems, fmt.Errorf("--batch-size is %d; it must be positive", *batchSize))
	}
	selected := cleaners
	if *only != "" {
		selected = nil
		for _, name := range strings.Split(*only, ",") {
			i := slices.IndexFunc(cleaners, func(c cleaner) bool { return c.name == strings.TrimSpace(name) })
			if i < 0 {
				problems = append(problems, fmt.Errorf("--only: unknown table %q; known: %s", name, strings.Join(names, ", ")))
				continue
			}
			selected = append(selected, cleaners[i])
		}
	}
	var schedule retention.Schedule
	switch {
	case *every < 0:
		problems = append(problems, fmt.Errorf("--every is %s; it must be positive", *every))
	case *every > 0 && *dailyAt != "":
		problems = append(problems, errors.New("--every and --daily-at both given; choose one"))
	case *every > 0:
		schedule = retention.Every(*every)
	case *dailyAt != "":
		s, err := retention.ParseDailyAt(*dailyAt)
		if err != nil {
			problems = append(problems, fmt.Errorf("--daily-at: %w", err))
		} else {
			schedule = s
		}
	}
	if *dry && schedule != nil {
		problems = append(problems, errors.New("--dry-run counts once: drop --every / --daily-at"))
	}
	if err := db.validate(); err != nil {
		problems = append(problems, err)
	}
	if sagaDB.url == "" && sagaDB.schema != "" {
		problems = append(problems, errors.New("--saga-schema without --saga-database-url: give the orchestrator's database too"))
	} else if sagaDB.url != "" {
		if sagaDB.schema == "" {
			sagaDB.schema = db.schema
		}
		if err := pgsql.ValidateSchema(sagaDB.schema); err != nil {
			problems = append(problems, fmt.Errorf("--saga-schema: %w", err))
		}
	}
	if err := errors.Join(problems...); err != nil {
		return err
	}

	pool, err := db.connectMigrated(ctx, "onceflow-cleanup")
	if err != nil {
		return err
	}
	defer pool.Close()
	var sagas *sagaSource
	if sagaDB.url != "" {
		sagaPool, err := sagaDB.connect(ctx, "onceflow-cleanup")
		if err != nil {
			return fmt.Errorf("--saga-database-url: %w", err)
		}
		defer sagaPool.Close()
		admin, err := saga.NewAdmin(sagaDB.schema)
		if err != nil {
			return err
		}
		sagas = &sagaSource{pool: sagaPool, admin: admin}
	}
	logger := slog.New(slog.NewTextHandler(c.stderr, nil))
	opts := cleanupOptions{schema: db.schema, window: window, allowShort: *allowShort, batchSize: *batchSize, logger: logger, sagas: sagas}
	if *dry {
		return dryRun(ctx, pool, &printer{w: c.stdout}, opts, selected)
	}
	out := c.stdout // the loop below names each cleaner c
	cleanAll := func(ctx context.Context) (int64, error) {
		var total int64
		var errs []error
		for _, c := range selected {
			start := time.Now()
			n, err := c.clean(ctx, pool, opts)
			total += n
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", c.name, err))
				continue
			}
			fmt.Fprintf(out, "%s: deleted %d expired rows in %s\n", c.name, n, time.Since(start).Round(time.Millisecond))
		}
		return total, errors.Join(errs...)
	}
	if schedule == nil {
		_, err := cleanAll(ctx)
		return err
	}
	err = cleaning.Run(ctx, schedule, logger, cleanAll)
	if errors.Is(err, context.Canceled) {
		return nil // stopped by SIGTERM or Ctrl-C: a normal end for a scheduled cleaner
	}
	return err
}
