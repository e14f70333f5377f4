// Package pgbouncertest starts a throwaway PgBouncer in front of the test PostgreSQL server
// (internal/testdb's), so a test can run onceflow through a connection pooler as production
// often does: the binary from PATH or /usr/sbin (Debian's package pgbouncer; .ci/run installs
// it), on a free port, with its files in the test's temporary folder, stopped when the test
// ends.
//
// PgBouncer forwards every database name to the test server ("*" in [databases]) and logs in
// with the test server's user (and its password, when DATABASE_URL has one); clients are
// trusted, as the throwaway cluster trusts them. Like PostgreSQL it refuses to run as root,
// so under root it runs as the "postgres" user, as internal/embedded runs the cluster.
package pgbouncertest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/embedded"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/internal/testutil"
)

// Options tunes a PgBouncer. The zero value is transaction pooling with 20 server connections
// per database and user.
type Options struct {
	// PoolMode is PgBouncer's pool_mode: "transaction" (default), "session" or "statement".
	PoolMode string
	// PoolSize is default_pool_size: the server connections PgBouncer opens per database and
	// user, shared by every client. Default 20.
	PoolSize int
	// Extra lines for the [pgbouncer] section, e.g. "max_prepared_statements = 100" (PgBouncer
	// 1.21 or newer).
	Extra []string
}

// Bouncer is a running PgBouncer.
type Bouncer struct {
	port   int
	server *url.URL // the test server's URL
	cmd    *exec.Cmd
	exited chan struct{}
	output *testutil.SyncBuffer
	dir    string
}

// Start runs a PgBouncer in front of the test server (testdb.URL) and waits until it accepts
// connections. It fails the test when the pgbouncer binary is missing.
func Start(t testing.TB, opts Options) *Bouncer {
	t.Helper()
	bin, err := Binary()
	if err != nil {
		t.Fatalf("pgbouncertest: %v", err)
	}
	if opts.PoolMode == "" {
		opts.PoolMode = "transaction"
	}
	if opts.PoolSize == 0 {
		opts.PoolSize = 20
	}
	server, err := url.Parse(testdb.URL(t))
	if err != nil {
		t.Fatalf("pgbouncertest: parse the test server's URL: %v", err)
	}
	var lastErr error
	// A free port can be taken between choosing and binding it; try a few.
	for range 3 {
		b, err := start(t, bin, server, opts)
		if err == nil {
			t.Cleanup(b.Stop)
			return b
		}
		lastErr = err
	}
	t.Fatalf("pgbouncertest: %v", lastErr)
	return nil
}

// Binary returns the path of the pgbouncer binary: on PATH, else Debian's /usr/sbin/pgbouncer
// (/usr/sbin is not on every user's PATH).
func Binary() (string, error) {
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, nil
	}
	if _, err := os.Stat("/usr/sbin/pgbouncer"); err == nil {
		return "/usr/sbin/pgbouncer", nil
	}
	return "", errors.New("pgbouncer not found on PATH or in /usr/sbin; install it (Debian: apt-get install -y pgbouncer)")
}

// Version returns the first line of `pgbouncer --version`, e.g. "PgBouncer 1.18.0".
func Version() (string, error) {
	bin, err := Binary()
	if err != nil {
		return "", err
	}
	out, err := exec.Command(bin, "--version").Output()
	if err != nil {
		return "", err
	}
	line, _, _ := strings.Cut(string(out), "\n")
	return strings.TrimSpace(line), nil
}

func start(t testing.TB, bin string, server *url.URL, opts Options) (*Bouncer, error) {
	port, err := embedded.FreePort()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "onceflow-pgbouncer-")
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	var cred *syscall.Credential
	if os.Geteuid() == 0 {
		if cred, err = postgresCredential(); err != nil {
			return nil, err
		}
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			return nil, err
		}
	}
	host, serverPort := server.Hostname(), server.Port()
	if serverPort == "" {
		serverPort = "5432"
	}
	userName := server.User.Username()
	if userName == "" {
		userName = "postgres"
	}
	password, _ := server.User.Password()
	// The user list: with auth_type trust PgBouncer still wants the user listed; the password
	// (if any) is also what PgBouncer logs in to the server with.
	userlist := fmt.Sprintf("%q %q\n", userName, password)
	if err := os.WriteFile(filepath.Join(dir, "userlist.txt"), []byte(userlist), 0o600); err != nil {
		return nil, err
	}
	serverDB := fmt.Sprintf("host=%s port=%s user=%s", host, serverPort, userName)
	if sslmode := server.Query().Get("sslmode"); sslmode == "require" || sslmode == "verify-full" || sslmode == "verify-ca" {
		opts.Extra = append(opts.Extra, "server_tls_sslmode = "+sslmode)
	}
	ini := []string{
		"[databases]",
		// Every database name goes to the same-named database of the test server.
		"* = " + serverDB,
		"[pgbouncer]",
		"listen_addr = 127.0.0.1",
		"listen_port = " + strconv.Itoa(port),
		"unix_socket_dir =",
		"auth_type = trust",
		"auth_file = " + filepath.Join(dir, "userlist.txt"),
		"pool_mode = " + opts.PoolMode,
		"default_pool_size = " + strconv.Itoa(opts.PoolSize),
		"max_client_conn = 1000",
		"max_db_connections = 0",
		"logfile = " + filepath.Join(dir, "pgbouncer.log"),
		"pidfile = " + filepath.Join(dir, "pgbouncer.pid"),
		"admin_users = " + userName,
		"stats_users = " + userName,
		"log_connections = 0",
		"log_disconnections = 0",
		// Refuse nothing a pgx client sends at start-up that PgBouncer does not track itself
		// (it knows application_name, client_encoding, DateStyle, TimeZone and
		// standard_conforming_strings): extra_float_digits is lib/pq's. A search_path is NOT
		// ignored here, so a test learns that PgBouncer refuses it.
		"ignore_startup_parameters = extra_float_digits",
	}
	ini = append(ini, opts.Extra...)
	cfgPath := filepath.Join(dir, "pgbouncer.ini")
	if err := os.WriteFile(cfgPath, []byte(strings.Join(ini, "\n")+"\n"), 0o644); err != nil {
		return nil, err
	}
	if cred != nil { // PgBouncer, run as postgres, reads its files and writes its log there
		for _, f := range []string{"userlist.txt", "pgbouncer.ini"} {
			if err := os.Chown(filepath.Join(dir, f), int(cred.Uid), int(cred.Gid)); err != nil {
				return nil, err
			}
		}
	}
	cmd := exec.Command(bin, cfgPath) // in the foreground: the process is ours, stopped by pid
	out := &testutil.SyncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.Dir = dir
	// Pdeathsig: PgBouncer does not exit with its parent; a test binary killed by a timeout
	// must not leave it listening.
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start pgbouncer: %w", err)
	}
	b := &Bouncer{port: port, server: server, cmd: cmd, exited: make(chan struct{}), output: out, dir: dir}
	go func() { _ = cmd.Wait(); close(b.exited) }()

	deadline := time.Now().Add(30 * time.Second)
	for {
		select {
		case <-b.exited:
			return nil, fmt.Errorf("pgbouncer exited at start-up:\n%s\n%s", out.String(), b.Log())
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		conn, err := pgx.Connect(ctx, b.URL())
		if err == nil {
			_, err = conn.Exec(ctx, "SELECT 1", pgx.QueryExecModeSimpleProtocol)
			_ = conn.Close(ctx)
		}
		cancel()
		if err == nil {
			return b, nil
		}
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) || time.Now().After(deadline) { // an answer, but a refusal: waiting will not help
			b.Stop()
			return nil, errors.Join(fmt.Errorf("pgbouncer on port %d did not answer within 30s:\n%s", port, b.Log()), err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Port is the port PgBouncer listens on, on 127.0.0.1.
func (b *Bouncer) Port() int { return b.port }

// URL is the test server's connection string with PgBouncer's address instead of the
// server's: the same user, database and options.
func (b *Bouncer) URL() string {
	u := *b.server
	u.Host = net.JoinHostPort("127.0.0.1", strconv.Itoa(b.port))
	return u.String()
}

// Log returns PgBouncer's log so far, for a failing test's message.
func (b *Bouncer) Log() string {
	data, _ := os.ReadFile(filepath.Join(b.dir, "pgbouncer.log"))
	return string(data)
}

// Stop stops PgBouncer at once (SIGTERM: its clients lose their connections) and waits for it
// to exit. It is safe to call more than once.
func (b *Bouncer) Stop() {
	select {
	case <-b.exited:
		return
	default:
	}
	_ = b.cmd.Process.Signal(syscall.SIGTERM) // the process this package started, by its pid
	select {
	case <-b.exited:
	case <-time.After(10 * time.Second):
		_ = b.cmd.Process.Kill()
		<-b.exited
	}
}

// Pool returns a pool of at most maxConns connections to db's database through PgBouncer,
// closed when the test ends. tune, when not nil, adjusts the configuration first — this is
// where a test sets the pgx settings under test (DefaultQueryExecMode). Unlike testdb's
// pools it sets no search_path: PgBouncer refuses a search_path start-up parameter (every
// onceflow statement names its tables with their schema, so none is needed).
func (b *Bouncer) Pool(t testing.TB, db *testdb.DB, maxConns int32, tune func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(b.URL())
	if err != nil {
		t.Fatalf("pgbouncertest: %v", err)
	}
	if db != nil {
		dbURL, err := pgxpool.ParseConfig(db.URL)
		if err != nil {
			t.Fatalf("pgbouncertest: %v", err)
		}
		cfg.ConnConfig.Database = dbURL.ConnConfig.Database
	}
	cfg.MaxConns = maxConns
	if tune != nil {
		tune(cfg)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("pgbouncertest: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func postgresCredential() (*syscall.Credential, error) {
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("running as root needs a \"postgres\" user (PgBouncer refuses root): %w", err)
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err := errors.Join(err1, err2); err != nil {
		return nil, fmt.Errorf("parse the postgres user's uid/gid: %w", err)
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}
