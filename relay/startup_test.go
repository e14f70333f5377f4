package relay_test

import (
	"context"
	"errors"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// TestStartWaitsForDatabase: a relay started while PostgreSQL cannot be reached does not
// return from Run (a supervisor would crash-loop it); it reports itself unhealthy, and once the
// database answers it starts and delivers the rows. Before, Run returned the connection error.
func TestStartWaitsForDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 1)
	topic := kafkatest.Topic("startwait")
	want := writeEvents(t, db, topic, 50, 5, 10)
	c := newConsumer(t, brokers, topic)

	// A port nothing listens on yet: connections are refused, as when the server is down.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().(*net.TCPAddr)
	_ = ln.Close()
	pcfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	target := net.JoinHostPort(pcfg.ConnConfig.Host, strconv.Itoa(int(pcfg.ConnConfig.Port)))
	pcfg.ConnConfig.Host, pcfg.ConnConfig.Port = "127.0.0.1", uint16(addr.Port)
	pcfg.ConnConfig.RuntimeParams["search_path"] = db.Schema
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: brokers})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sink.Close() }()
	r, err := relay.New(relay.Config{Pool: pool, Sink: sink, Schema: db.Schema, Logger: testLogger(t),
		RetryBackoff: 20 * time.Millisecond, MaxRetryBackoff: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	runErr := make(chan error, 1)
	go func() { runErr <- r.Run(rctx) }()
	defer func() {
		cancel()
		if err := <-runErr; err != nil {
			t.Errorf("Run after the database came up: %v", err)
		}
	}()

	// Several refused attempts (backoff ≤ 100 ms): Run is still waiting, and unhealthy.
	deadline := time.After(time.Second)
	for waiting := true; waiting; {
		select {
		case err := <-runErr:
			runErr <- err // for the deferred check
			t.Fatalf("Run returned while the database was unreachable: %v", err)
		case <-deadline:
			waiting = false
		case <-time.After(50 * time.Millisecond):
			if r.Health() == nil {
				t.Fatal("Health() is nil while the database is unreachable")
			}
		}
	}

	// The database comes up (a proxy to the real server on that port): the relay starts.
	ln, err = net.Listen("tcp", addr.String())
	if err != nil {
		t.Fatalf("listen again on %s: %v", addr, err)
	}
	stop := proxy(t, ln, target)
	defer stop()
	got := c.waitDistinct(t, len(want), 30*time.Second)
	checkDelivery(t, want, got)
	eventually(t, 10*time.Second, "healthy", func() bool { return r.Health() == nil })
}

// TestStartRefusesMissingDatabase: a failure waiting cannot fix (the server answers that the
// database does not exist) is returned at once, not waited on.
func TestStartRefusesMissingDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	pcfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	pcfg.ConnConfig.Database = "no_such_database"
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	r, err := relay.New(relay.Config{Pool: pool, Sink: refuseAll{}, Schema: db.Schema, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	err = r.Run(rctx)
	if err == nil || rctx.Err() != nil {
		t.Fatalf("Run = %v (context: %v), want the missing database reported at once", err, rctx.Err())
	}
	if !strings.Contains(err.Error(), "no_such_database") {
		t.Fatalf("Run = %v, want it to name the database", err)
	}
}

// refuseAll is a sink that is never reached in these tests.
type refuseAll struct{}

func (refuseAll) Publish(_ context.Context, msgs []*relay.Message, errs []error) {
	for i := range msgs {
		errs[i] = errors.New("refuseAll: not reached")
	}
}

// proxy forwards every connection accepted on ln to target until stop.
func proxy(t testing.TB, ln net.Listener, target string) (stop func()) {
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			in, err := ln.Accept()
			if err != nil {
				if !errors.Is(err, net.ErrClosed) {
					t.Errorf("proxy accept: %v", err)
				}
				return
			}
			out, err := net.Dial("tcp", target)
			if err != nil {
				_ = in.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, in, out)
			mu.Unlock()
			wg.Add(2)
			go func() { defer wg.Done(); _, _ = io.Copy(out, in); _ = out.Close() }()
			go func() { defer wg.Done(); _, _ = io.Copy(in, out); _ = in.Close() }()
		}
	}()
	return func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	}
}

func (refuseAll) Close() error { return nil }
