// Package embedded starts throwaway infrastructure for tests, benchmarks and the demo:
// a PostgreSQL cluster from the installed binaries and an in-process Kafka (kfake).
// Nothing is downloaded; a cluster lives in a temporary folder and is removed by Stop.
package embedded

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// PostgresOptions tunes a throwaway cluster. The zero value is what tests use.
type PostgresOptions struct {
	// Durable keeps fsync and synchronous_commit on, as a production server would run.
	// Default false: tests trade durability for speed because the cluster is thrown away.
	Durable bool
	// CrashSafe keeps synchronous_commit on (fsync may stay off): a commit is acknowledged
	// only once its WAL was handed to the operating system, so a crash of the server process
	// (Halt, Restart) loses no acknowledged commit; only a crash of the host would. For tests
	// that halt or restart the server. Implied by Durable.
	CrashSafe bool
	// MaxConnections is the server's max_connections. Default 300, enough for parallel tests.
	MaxConnections int
	// Logf receives progress lines; nil discards them.
	Logf func(format string, args ...any)
}

// Postgres is a running throwaway cluster.
type Postgres struct {
	dir  string
	port int
	cred *syscall.Credential
	url  string
}

// URL is the connection string of the cluster's "postgres" database, as the superuser.
func (p *Postgres) URL() string { return p.url }

// Dir is the folder holding the cluster's data; removed by Stop.
func (p *Postgres) Dir() string { return p.dir }

// StartPostgres creates and starts a cluster in a new temporary folder with initdb and pg_ctl
// found on PATH (or in /usr/lib/postgresql/*/bin). When running as root it runs them as the
// "postgres" user, because PostgreSQL refuses to run as root.
func StartPostgres(ctx context.Context, opts PostgresOptions) (*Postgres, error) {
	if opts.MaxConnections == 0 {
		opts.MaxConnections = 300
	}
	logf := opts.Logf
	if logf == nil {
		logf = func(string, ...any) {}
	}
	initdb, err := findPGBinary("initdb")
	if err != nil {
		return nil, err
	}
	pgctl, err := findPGBinary("pg_ctl")
	if err != nil {
		return nil, err
	}
	reapOrphans(logf)
	p, err := newClusterDir()
	if err != nil {
		return nil, err
	}
	dir := p.dir
	port := p.port
	data := filepath.Join(dir, "data")
	start := time.Now()
	if out, err := p.run(ctx, initdb, "-D", data, "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C"); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("embedded postgres: initdb: %w\n%s", err, out)
	}
	conf := []string{
		"listen_addresses = '127.0.0.1'",
		"port = " + strconv.Itoa(port),
		"unix_socket_directories = '" + dir + "'",
		"max_connections = " + strconv.Itoa(opts.MaxConnections),
		"shared_buffers = 128MB",
		"log_min_messages = warning",
		"logging_collector = off",
	}
	switch {
	case opts.Durable:
	case opts.CrashSafe:
		conf = append(conf, "fsync = off", "full_page_writes = off")
	default:
		conf = append(conf, "fsync = off", "synchronous_commit = off", "full_page_writes = off")
	}
	if err := appendConf(data, conf...); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("embedded postgres: write config: %w", err)
	}
	if err := p.startServer(ctx, pgctl); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	// pg_ctl -w returns when the server accepts connections; check once so a broken start is
	// reported here rather than as a confusing failure in the first test.
	conn, err := pgx.Connect(ctx, p.url)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("embedded postgres: connect after start: %w", err), p.Stop())
	}
	conn.Close(ctx)
	logf("embedded postgres on port %d started in %s (%s)", p.port, time.Since(start).Round(time.Millisecond), dir)
	return p, nil
}

// newClusterDir creates the temporary folder of a new cluster (owned by the "postgres" user
// when running as root), with the owner file reapOrphans reads, and picks a free port.
func newClusterDir() (*Postgres, error) {
	dir, err := os.MkdirTemp("", dirPrefix)
	if err != nil {
		return nil, fmt.Errorf("embedded postgres: create temp dir: %w", err)
	}
	// The owner's pid lets a later start remove this cluster if the owner dies without Stop
	// (SIGKILL, a test timeout): PostgreSQL does not exit with its parent.
	if err := os.WriteFile(filepath.Join(dir, ownerFile), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("embedded postgres: write owner file: %w", err)
	}
	p := &Postgres{dir: dir}
	if os.Geteuid() == 0 {
		cred, err := postgresCredential()
		if err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
		p.cred = cred
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("embedded postgres: chown %s: %w", dir, err)
		}
	}
	if p.port, err = FreePort(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	return p, nil
}

// startServer starts the cluster in p.dir/data (its config already names p.port) and sets
// p.url. The port was free when chosen, seconds ago (initdb or pg_basebackup ran since):
// another process (a test binary's Kafka, another cluster) may have taken it. Then it starts
// again on a new port; the last "port" line of the config wins.
func (p *Postgres) startServer(ctx context.Context, pgctl string) error {
	data := filepath.Join(p.dir, "data")
	for try := 1; ; try++ {
		out, err := p.run(ctx, pgctl, "-D", data, "-l", filepath.Join(p.dir, "server.log"), "-w", "-t", "60", "start")
		if err == nil {
			break
		}
		log, _ := os.ReadFile(filepath.Join(p.dir, "server.log"))
		if try < 5 && strings.Contains(string(log), "Address already in use") {
			port, err := FreePort()
			if err == nil {
				err = appendConf(data, "port = "+strconv.Itoa(port))
			}
			if err == nil {
				p.port = port
				continue
			}
		}
		return fmt.Errorf("embedded postgres: pg_ctl start: %w\n%s\n%s", err, out, log)
	}
	p.url = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", p.port)
	return nil
}

// Stop shuts the cluster down immediately and removes its folder.
func (p *Postgres) Stop() error {
	if p == nil {
		return nil
	}
	pgctl, err := findPGBinary("pg_ctl")
	var stopErr error
	// A halted server (Halt, or a primary killed in a failover test) has nothing to stop.
	_, statErr := os.Stat(filepath.Join(p.dir, "data", "postmaster.pid"))
	if err == nil && statErr == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if out, err := p.run(ctx, pgctl, "-D", filepath.Join(p.dir, "data"), "-m", "immediate", "-w", "stop"); err != nil {
			stopErr = fmt.Errorf("embedded postgres: pg_ctl stop: %w\n%s", err, out)
		}
	}
	if err := os.RemoveAll(p.dir); err != nil && stopErr == nil {
		stopErr = err
	}
	return stopErr
}

// Halt stops the server at once, as a crash or an operator's `pg_ctl stop -m immediate` would
// (clients lose their connections mid-statement), and keeps its data: Resume starts it again
// on the same port. For tests of outages. Start such a cluster CrashSafe (testdb.NewServer
// does): with synchronous_commit off, a halt loses the last commits it acknowledged.
func (p *Postgres) Halt(ctx context.Context) error {
	pgctl, err := findPGBinary("pg_ctl")
	if err != nil {
		return err
	}
	if out, err := p.run(ctx, pgctl, "-D", filepath.Join(p.dir, "data"), "-m", "immediate", "-w", "stop"); err != nil {
		return fmt.Errorf("embedded postgres: pg_ctl stop: %w\n%s", err, out)
	}
	return nil
}

// Resume starts a halted server again (it recovers from its WAL first) and returns when it
// accepts connections.
func (p *Postgres) Resume(ctx context.Context) error {
	pgctl, err := findPGBinary("pg_ctl")
	if err != nil {
		return err
	}
	if out, err := p.run(ctx, pgctl, "-D", filepath.Join(p.dir, "data"), "-l", filepath.Join(p.dir, "server.log"), "-w", "-t", "60", "start"); err != nil {
		return fmt.Errorf("embedded postgres: pg_ctl start: %w\n%s", err, out)
	}
	return nil
}

// Restart is Halt then Resume: an immediate restart, the way a crash-restart or a failover
// looks to clients.
func (p *Postgres) Restart(ctx context.Context) error {
	if err := p.Halt(ctx); err != nil {
		return err
	}
	return p.Resume(ctx)
}

func (p *Postgres) run(ctx context.Context, bin string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Dir = p.dir
	cmd.Env = append(os.Environ(), "LC_ALL=C")
	if p.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: p.cred}
	}
	return cmd.CombinedOutput()
}

const (
	dirPrefix = "onceflow-pg-"
	ownerFile = "owner.pid"
)

// reapOrphans stops and removes clusters left in the temp folder by processes that died
// without calling Stop. Best effort: errors are ignored.
func reapOrphans(logf func(string, ...any)) {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), dirPrefix+"*"))
	for _, dir := range dirs {
		b, err := os.ReadFile(filepath.Join(dir, ownerFile))
		if err != nil {
			continue // not ours, or still being created
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || pid <= 0 || processAlive(pid) {
			continue
		}
		orphan := &Postgres{dir: dir}
		if os.Geteuid() == 0 {
			orphan.cred, _ = postgresCredential()
		}
		if err := orphan.Stop(); err == nil {
			logf("embedded postgres: removed orphaned cluster %s (owner pid %d is gone)", dir, pid)
		}
	}
}

func processAlive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

func findPGBinary(name string) (string, error) {
	if path, err := exec.LookPath(name); err == nil {
		return path, nil
	}
	matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin/" + name)
	if len(matches) > 0 {
		return matches[len(matches)-1], nil
	}
	return "", fmt.Errorf("embedded postgres: %s not found on PATH or in /usr/lib/postgresql/*/bin; install PostgreSQL (apt-get install -y postgresql) or set DATABASE_URL", name)
}

func postgresCredential() (*syscall.Credential, error) {
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("embedded postgres: running as root needs a \"postgres\" user (PostgreSQL refuses root): %w", err)
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err := errors.Join(err1, err2); err != nil {
		return nil, fmt.Errorf("embedded postgres: parse postgres uid/gid: %w", err)
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

// appendConf appends lines to the cluster's postgresql.conf (a later setting overrides an
// earlier one).
func appendConf(data string, lines ...string) error {
	f, err := os.OpenFile(filepath.Join(data, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString("\n" + strings.Join(lines, "\n") + "\n")
	return errors.Join(err, f.Close())
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago, for a server the
// caller is about to start.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
