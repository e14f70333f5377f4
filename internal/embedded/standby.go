package embedded

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// A primary and a streaming standby, for tests of a failover (what a Patroni or
// pg_auto_failover pair does, by hand):
//
//	primary, _ := embedded.StartPostgres(ctx, embedded.PostgresOptions{CrashSafe: true})
//	standby, _ := primary.StartStandby(ctx, embedded.StandbyOptions{Name: "s1"})
//	_ = primary.SetSynchronousStandby(ctx, "s1") // or leave it asynchronous
//	url := embedded.MultiHostURL(primary, standby) // target_session_attrs=read-write
//	... clients on url ...
//	_ = primary.Halt(ctx)      // pg_ctl stop -m immediate: the primary dies
//	_ = standby.Promote(ctx)   // pg_ctl promote: clients reconnect to it
//
// The standby is a cluster of its own (its own temporary folder, port and Stop), made with
// pg_basebackup -R from the primary: the same system identifier, streaming from the primary
// under the application_name StandbyOptions.Name, which synchronous_standby_names refers to.

// StandbyOptions tunes StartStandby.
type StandbyOptions struct {
	// Name is the standby's application_name in its primary_conninfo, the name the primary's
	// synchronous_standby_names and pg_stat_replication use. Default "standby".
	Name string
	// Logf receives progress lines; nil discards them.
	Logf func(format string, args ...any)
}

// Port is the TCP port the cluster listens on (127.0.0.1).
func (p *Postgres) Port() int { return p.port }

// StartStandby creates a streaming standby of the running cluster p: pg_basebackup -R (a copy
// of p's data with standby.signal and primary_conninfo) into a new temporary folder, started
// on a port of its own. It returns once p reports the standby as streaming. The standby is
// asynchronous until SetSynchronousStandby names it. Stop it like any cluster.
func (p *Postgres) StartStandby(ctx context.Context, opts StandbyOptions) (*Postgres, error) {
	if opts.Name == "" {
		opts.Name = "standby"
	}
	logf := opts.Logf
	if logf == nil {
		logf = func(string, ...any) {}
	}
	pgctl, err := findPGBinary("pg_ctl")
	if err != nil {
		return nil, err
	}
	basebackup, err := findPGTool("pg_basebackup")
	if err != nil {
		return nil, err
	}
	s, err := newClusterDir()
	if err != nil {
		return nil, err
	}
	start := time.Now()
	data := filepath.Join(s.dir, "data")
	// application_name goes into the primary_conninfo that -R writes.
	conninfo := fmt.Sprintf("host=127.0.0.1 port=%d user=postgres application_name=%s", p.port, opts.Name)
	if out, err := s.run(ctx, basebackup, "-d", conninfo, "-D", data, "-R", "-X", "stream", "-c", "fast", "--no-sync"); err != nil {
		os.RemoveAll(s.dir)
		return nil, fmt.Errorf("embedded postgres: pg_basebackup: %w\n%s", err, out)
	}
	// The copied postgresql.conf names the primary's port and socket folder; the last line wins.
	if err := appendConf(data, "port = "+strconv.Itoa(s.port), "unix_socket_directories = '"+s.dir+"'"); err != nil {
		os.RemoveAll(s.dir)
		return nil, fmt.Errorf("embedded postgres: write standby config: %w", err)
	}
	if err := s.startServer(ctx, pgctl); err != nil {
		os.RemoveAll(s.dir)
		return nil, err
	}
	if err := p.waitReplication(ctx, opts.Name, "streaming", ""); err != nil {
		return nil, errors.Join(err, s.Stop())
	}
	logf("embedded postgres standby %q on port %d (of the primary on %d) started in %s", opts.Name, s.port, p.port, time.Since(start).Round(time.Millisecond))
	return s, nil
}

// SetSynchronousStandby sets the primary's synchronous_standby_names to name and reloads its
// configuration: from then on a commit returns only once that standby has flushed it
// (synchronous_commit stays what the cluster was started with; use CrashSafe or Durable, where
// it is on). It returns once the standby is reported synchronous. An empty name makes
// replication asynchronous again.
func (p *Postgres) SetSynchronousStandby(ctx context.Context, name string) error {
	conn, err := pgx.Connect(ctx, p.url)
	if err != nil {
		return fmt.Errorf("embedded postgres: connect: %w", err)
	}
	defer conn.Close(ctx)
	// ALTER SYSTEM takes no parameters; the name is quoted as a literal.
	lit := "'" + strings.ReplaceAll(name, "'", "''") + "'"
	if _, err := conn.Exec(ctx, "ALTER SYSTEM SET synchronous_standby_names = "+lit); err != nil {
		return fmt.Errorf("embedded postgres: set synchronous_standby_names: %w", err)
	}
	if _, err := conn.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
		return fmt.Errorf("embedded postgres: reload config: %w", err)
	}
	if name == "" {
		return nil
	}
	return p.waitReplication(ctx, name, "streaming", "sync")
}

// waitReplication waits until pg_stat_replication on p shows the standby named name in
// state (and, unless syncState is "", with that sync_state).
func (p *Postgres) waitReplication(ctx context.Context, name, state, syncState string) error {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, p.url)
	if err != nil {
		return fmt.Errorf("embedded postgres: connect: %w", err)
	}
	defer conn.Close(context.Background())
	for {
		var st, sync string
		err := conn.QueryRow(ctx, `SELECT state, sync_state FROM pg_stat_replication WHERE application_name = $1`, name).Scan(&st, &sync)
		if err == nil && st == state && (syncState == "" || sync == syncState) {
			return nil
		}
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("embedded postgres: read pg_stat_replication: %w", err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("embedded postgres: standby %q not %s %s (last seen %q %q): %w", name, state, syncState, st, sync, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Promote ends a standby's recovery (pg_ctl promote, which waits until it accepts writes):
// it becomes a primary on a new timeline. Whatever its primary had not sent it is not there.
func (p *Postgres) Promote(ctx context.Context) error {
	pgctl, err := findPGBinary("pg_ctl")
	if err != nil {
		return err
	}
	if out, err := p.run(ctx, pgctl, "-D", filepath.Join(p.dir, "data"), "-w", "-t", "60", "promote"); err != nil {
		return fmt.Errorf("embedded postgres: pg_ctl promote: %w\n%s", err, out)
	}
	return nil
}

// MultiHostURL is a connection string naming every server, in order, with
// target_session_attrs=read-write: pgx tries them in turn and keeps the first that accepts
// writes, so clients given it follow a failover by reconnecting.
func MultiHostURL(servers ...*Postgres) string {
	hosts := make([]string, len(servers))
	for i, s := range servers {
		hosts[i] = "127.0.0.1:" + strconv.Itoa(s.port)
	}
	return "postgres://postgres@" + strings.Join(hosts, ",") + "/postgres?sslmode=disable&target_session_attrs=read-write&connect_timeout=5"
}

// findPGTool finds a PostgreSQL client program of the same installation as initdb: Debian
// puts wrappers of some of them on PATH (pg_wrapper), which pick a version of their own.
func findPGTool(name string) (string, error) {
	if initdb, err := findPGBinary("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(initdb); err == nil {
			path := filepath.Join(filepath.Dir(real), name)
			if _, err := os.Stat(path); err == nil {
				return path, nil
			}
		}
	}
	return findPGBinary(name)
}

// WaitReplayed waits until the standby p has replayed everything the primary had written when
// it was called (pg_current_wal_lsn on primary, pg_last_wal_replay_lsn on p).
func (p *Postgres) WaitReplayed(ctx context.Context, primary *Postgres) error {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	pc, err := pgx.Connect(ctx, primary.url)
	if err != nil {
		return fmt.Errorf("embedded postgres: connect to primary: %w", err)
	}
	defer pc.Close(context.Background())
	var target string
	if err := pc.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&target); err != nil {
		return fmt.Errorf("embedded postgres: read primary WAL position: %w", err)
	}
	sc, err := pgx.Connect(ctx, p.url)
	if err != nil {
		return fmt.Errorf("embedded postgres: connect to standby: %w", err)
	}
	defer sc.Close(context.Background())
	for {
		var done bool
		if err := sc.QueryRow(ctx, `SELECT coalesce(pg_last_wal_replay_lsn() >= $1::text::pg_lsn, false)`, target).Scan(&done); err != nil {
			return fmt.Errorf("embedded postgres: read standby replay position: %w", err)
		}
		if done {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("embedded postgres: standby did not replay up to %s: %w", target, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}
