package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/pgsql"
)

// newFlagSet returns a flag set that reports errors instead of exiting, with a usage text
// that starts with the command's synopsis.
func (c *cli) newFlagSet(name, synopsis string) *flag.FlagSet {
	fs := flag.NewFlagSet("onceflow "+name, flag.ContinueOnError)
	fs.SetOutput(c.stderr)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: onceflow %s\n\nFlags (environment variable in brackets):\n", synopsis)
		fs.PrintDefaults()
	}
	return fs
}

// parse parses args and maps flag errors to errUsage (the flag package already printed why).
func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return errUsage
	}
	return nil
}

// envOr returns the environment variable's value, or def when it is unset or empty.
func (c *cli) envOr(name, def string) string {
	if v := c.getenv(name); v != "" {
		return v
	}
	return def
}

// dbFlags are the connection flags every database command shares.
type dbFlags struct {
	url    string
	schema string
}

func (c *cli) addDBFlags(fs *flag.FlagSet) *dbFlags {
	d := &dbFlags{}
	fs.StringVar(&d.url, "database-url", c.getenv("DATABASE_URL"), "PostgreSQL connection string [DATABASE_URL]")
	fs.StringVar(&d.schema, "schema", c.envOr("ONCEFLOW_SCHEMA", pgsql.DefaultSchema), "schema holding the onceflow tables [ONCEFLOW_SCHEMA]")
	return d
}

func (d *dbFlags) validate() error {
	var problems []string
	if d.url == "" {
		problems = append(problems, "no database: set DATABASE_URL or pass --database-url postgres://user@host:5432/db")
	}
	if err := pgsql.ValidateSchema(d.schema); err != nil {
		problems = append(problems, err.Error())
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

// connect opens a pool and checks it with a ping. The connections carry application_name
// (unless the URL sets one) so pg_stat_activity shows which onceflow command holds them.
func (d *dbFlags) connect(ctx context.Context, applicationName string) (*pgxpool.Pool, error) {
	if err := d.validate(); err != nil {
		return nil, err
	}
	cfg, err := pgxpool.ParseConfig(d.url)
	if err != nil {
		return nil, fmt.Errorf("parse database URL: %w", err)
	}
	if cfg.ConnConfig.RuntimeParams["application_name"] == "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = applicationName
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to database: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connect to database: %w", err)
	}
	return pool, nil
}
