package testdb

import (
	"context"
	"errors"
	"io"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Proxy forwards TCP connections to the test server and can cut them all at once, in the
// middle of a statement, as a network failure or a crashed host does: the client's connection
// drops without a word from the server. The server-side backends are not told; end them with
// pg_terminate_backend (as TCP keepalive would, much later) when their locks matter.
type Proxy struct {
	port  uint16
	mu    sync.Mutex
	conns []net.Conn
}

// NewProxy starts a proxy to db's server, closed when the test ends.
func NewProxy(t testing.TB, db *DB) *Proxy {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	target := net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port)))
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{port: uint16(l.Addr().(*net.TCPAddr).Port)}
	var wg sync.WaitGroup
	t.Cleanup(func() { _ = l.Close(); p.Cut(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			in, err := l.Accept()
			if err != nil {
				return
			}
			out, err := net.Dial("tcp", target)
			if err != nil {
				_ = in.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, in, out)
			p.mu.Unlock()
			wg.Add(2)
			go func() { defer wg.Done(); _, _ = io.Copy(out, in); _ = out.Close() }()
			go func() { defer wg.Done(); _, _ = io.Copy(in, out); _ = in.Close() }()
		}
	}()
	return p
}

// Pool returns a pool of maxConns connections to db's schema through the proxy, closed when
// the test ends.
func (p *Proxy) Pool(t testing.TB, db *DB, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", p.port
	cfg.ConnConfig.RuntimeParams["search_path"] = "" // as New's pools: every table named with its schema
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// Cut closes every connection made through the proxy so far; later ones go through.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.conns = nil
}

// CutWhileSleeping waits until backend pid runs a statement starting with `SELECT pg_sleep`
// (checked on db's own pool, not through the proxy), cuts the proxy's connections, then
// terminates the backend so that its transaction releases its locks now.
func (p *Proxy) CutWhileSleeping(ctx context.Context, db *DB, pid uint32) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND state = 'active' AND query LIKE 'SELECT pg_sleep%'`,
			int64(pid)).Scan(&n); err != nil {
			return err
		}
		if n > 0 {
			break
		}
		if time.Now().After(deadline) {
			return errors.New("testdb: the statement did not start within 30 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	p.Cut()
	_, err := db.Pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, int64(pid))
	return err
}
