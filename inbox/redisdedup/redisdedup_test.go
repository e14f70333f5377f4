package redisdedup_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/redisdedup"
	"github.com/onceflow/onceflow/internal/redistest"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/outbox"
)

const childEnv = "ONCEFLOW_REDISDEDUP_TEST_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(childMain())
	}
	testutil.Main(m) // fails the run when a test leaves goroutines behind
}

// mailer is an effect outside PostgreSQL: it "sends" mails into a list.
type mailer struct {
	mu   sync.Mutex
	sent []string
	fail atomic.Int32 // fail this many sends
}

func (m *mailer) handler(msg *message.Message) ([]*message.Message, error) {
	if m.fail.Load() > 0 {
		m.fail.Add(-1)
		return nil, errors.New("smtp: 451 try again later")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.sent = append(m.sent, msg.UUID)
	return nil, nil
}

func (m *mailer) count() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.sent)
}

func newStore(t *testing.T, client redis.UniversalClient, metrics inbox.Metrics, mod func(*redisdedup.Config)) *redisdedup.Store {
	t.Helper()
	cfg := redisdedup.Config{Client: client, Consumer: "mailer", Metrics: metrics}
	if mod != nil {
		mod(&cfg)
	}
	s, err := redisdedup.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestDeliveredFiveTimesSendsOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := redistest.Start(t).Client(t)
	metrics := &inbox.Counters{}
	s := newStore(t, client, metrics, nil)
	m := &mailer{}
	h := s.Middleware(m.handler)
	msg := outbox.NewMessage([]byte("welcome"))
	for i := range 5 {
		if _, err := h(msg.Copy()); err != nil {
			t.Fatalf("delivery %d: %v", i+1, err)
		}
	}
	if m.count() != 1 {
		t.Fatalf("sent %d mails, want 1", m.count())
	}
	if snap := metrics.Snapshot(); snap.Processed != 1 || snap.Duplicates != 4 {
		t.Fatalf("metrics %+v", snap)
	}
	key := "onceflow:dedup:mailer:event:" + msg.UUID
	if s.Key("event:"+msg.UUID) != key {
		t.Fatalf("Key = %q", s.Key("event:"+msg.UUID))
	}
	val, err := client.Get(ctx, key).Result()
	if err != nil || !strings.HasPrefix(val, "d:") {
		t.Fatalf("record %q (%v), want a done record", val, err)
	}
	ttl, err := client.PTTL(ctx, key).Result()
	if err != nil || ttl <= 71*time.Hour || ttl > 72*time.Hour {
		t.Fatalf("record TTL %s (%v), want the 72h default", ttl, err)
	}
}

// A failed or panicking effect releases the key, so the redelivery sends the mail.
func TestFailedEffectReleasesKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := redistest.Start(t).Client(t)
	metrics := &inbox.Counters{}
	s := newStore(t, client, metrics, nil)
	m := &mailer{}
	m.fail.Store(1)
	msg := outbox.NewMessage([]byte("welcome"))
	key := s.Key("event:" + msg.UUID)
	if _, err := s.Middleware(m.handler)(msg); err == nil || !strings.Contains(err.Error(), "451") {
		t.Fatalf("err = %v, want the handler's error", err)
	}
	if n, _ := client.Exists(ctx, key).Result(); n != 0 {
		t.Fatal("a failed effect kept its claim: the redelivery would be refused until the lease expires")
	}
	panicking := s.Middleware(func(*message.Message) ([]*message.Message, error) { panic("template bug") })
	if _, err := middleware.Recoverer(panicking)(msg.Copy()); err == nil {
		t.Fatal("panic not reported")
	}
	if n, _ := client.Exists(ctx, key).Result(); n != 0 {
		t.Fatal("a panicking effect kept its claim")
	}
	if _, err := s.Middleware(m.handler)(msg.Copy()); err != nil || m.count() != 1 {
		t.Fatalf("redelivery: %v, sent %d", err, m.count())
	}
	if snap := metrics.Snapshot(); snap.Failures != 2 || snap.Processed != 1 {
		t.Fatalf("metrics %+v", snap)
	}
}

// While one delivery holds the claim, another is refused with ErrInProgress (so the broker
// redelivers it) rather than acknowledged: the first one's effect may still fail.
func TestConcurrentCopyIsRetriedNotSkipped(t *testing.T) {
	t.Parallel()
	client := redistest.Start(t).Client(t)
	metrics := &inbox.Counters{}
	s := newStore(t, client, metrics, nil)
	m := &mailer{}
	entered, release := make(chan struct{}), make(chan struct{})
	slow := s.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		close(entered)
		<-release
		return nil, errors.New("first delivery fails after all")
	})
	msg := outbox.NewMessage([]byte("welcome"))
	first := make(chan error, 1)
	go func() { _, err := slow(msg.Copy()); first <- err }()
	<-entered
	if _, err := s.Middleware(m.handler)(msg.Copy()); !errors.Is(err, redisdedup.ErrInProgress) || m.count() != 0 {
		t.Fatalf("concurrent copy: err %v, sent %d; want ErrInProgress and no mail", err, m.count())
	}
	close(release)
	if err := <-first; err == nil {
		t.Fatal("first delivery did not fail")
	}
	// The redelivery of the refused copy now sends the mail, and later ones are duplicates.
	for range 2 {
		if _, err := s.Middleware(m.handler)(msg.Copy()); err != nil {
			t.Fatal(err)
		}
	}
	if m.count() != 1 {
		t.Fatalf("sent %d, want 1", m.count())
	}
	if snap := metrics.Snapshot(); snap.Duplicates != 1 || snap.Processed != 1 || snap.Failures != 2 {
		t.Fatalf("metrics %+v", snap)
	}
}

// childMain runs the middleware on one message whose handler "sends" the mail (appends a line
// to a file) and then SIGKILLs the process: the crash between effect and record.
func childMain() int {
	s, err := redisdedup.New(redisdedup.Config{
		Client:   redis.NewClient(&redis.Options{Addr: os.Getenv("CHILD_REDIS")}),
		Consumer: "mailer",
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	msg := message.NewMessage(os.Getenv("CHILD_UUID"), []byte("welcome"))
	_, err = s.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		f, err := os.OpenFile(os.Getenv("CHILD_OUTBOX_FILE"), os.O_APPEND|os.O_WRONLY|os.O_CREATE, 0o600)
		if err != nil {
			return nil, err
		}
		fmt.Fprintln(f, "sent", msg.UUID)
		f.Close()
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	})(msg)
	fmt.Fprintln(os.Stderr, "not killed:", err)
	return 1
}

// The documented weaker guarantee, with a real crash: a consumer killed after the effect and
// before the record leaves a claim; redeliveries are refused while the lease runs, and once it
// runs out the effect is repeated.
func TestCrashBetweenEffectAndRecordRepeatsEffect(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := redistest.Start(t)
	client := srv.Client(t)
	msg := outbox.NewMessage([]byte("welcome"))
	sentFile := t.TempDir() + "/sent"
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1", "CHILD_REDIS="+srv.Addr(), "CHILD_UUID="+msg.UUID, "CHILD_OUTBOX_FILE="+sentFile)
	out, err := cmd.CombinedOutput()
	ws, _ := cmd.ProcessState.Sys().(syscall.WaitStatus)
	if !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("child not killed (%v): %s", err, out)
	}
	sent := func() int {
		b, _ := os.ReadFile(sentFile)
		return strings.Count(string(b), "sent ")
	}
	if sent() != 1 {
		t.Fatalf("child sent %d mails before the crash, want 1", sent())
	}

	s := newStore(t, client, nil, nil) // default 1-minute lease, like the child
	m := &mailer{}
	if _, err := s.Middleware(m.handler)(msg.Copy()); !errors.Is(err, redisdedup.ErrInProgress) || m.count() != 0 {
		t.Fatalf("within the lease: err %v, sent %d; want ErrInProgress", err, m.count())
	}
	// Let the lease run out without waiting a minute.
	key := s.Key("event:" + msg.UUID)
	if ok, err := client.PExpire(ctx, key, time.Millisecond).Result(); err != nil || !ok {
		t.Fatalf("expire the claim: %v %v", ok, err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for n, _ := client.Exists(ctx, key).Result(); n != 0; n, _ = client.Exists(ctx, key).Result() {
		if time.Now().After(deadline) {
			t.Fatal("claim did not expire")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if _, err := s.Middleware(m.handler)(msg.Copy()); err != nil {
		t.Fatal(err)
	}
	if total := sent() + m.count(); total != 2 {
		t.Fatalf("mails sent %d; the documented weaker guarantee is that the crash repeats the effect once", total)
	}
}

// With Redis gone the handler does not run and the message fails (nack), never acknowledged
// without a record.
func TestRedisDownFailsMessage(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	client := srv.Client(t)
	s := newStore(t, client, nil, nil)
	srv.Stop()
	m := &mailer{}
	if _, err := s.Middleware(m.handler)(outbox.NewMessage([]byte("x"))); err == nil || m.count() != 0 {
		t.Fatalf("err %v, sent %d; want an error and no mail", err, m.count())
	}
}

func TestNoKeyAndConfig(t *testing.T) {
	t.Parallel()
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled below
	defer client.Close()
	m := &mailer{}
	s := newStore(t, client, nil, nil)
	if _, err := s.Middleware(m.handler)(message.NewMessage("", nil)); !errors.Is(err, inbox.ErrNoKey) {
		t.Fatalf("keyless: %v", err)
	}
	drop := newStore(t, client, nil, func(c *redisdedup.Config) { c.NoKeyPolicy = inbox.DropNoKey })
	if _, err := drop.Middleware(m.handler)(message.NewMessage("", nil)); err != nil || m.count() != 0 {
		t.Fatalf("DropNoKey: %v", err)
	}

	_, err := redisdedup.New(redisdedup.Config{Consumer: "a:b", Window: time.Hour, Lease: -1, NoKeyPolicy: 9})
	for _, want := range []string{"Client is nil", "must not contain ':'", "Window is 1h0m0s, under the 24h0m0s minimum", "Lease is -1ns", "NoKeyPolicy is NoKeyPolicy(9)"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error %v does not report %q", err, want)
		}
	}
	short, err := redisdedup.New(redisdedup.Config{Client: client, Consumer: "m", Window: time.Hour, AllowShortWindow: true})
	if err != nil {
		t.Fatal(err)
	}
	if c := short.Config(); c.Window != time.Hour || c.Lease != redisdedup.DefaultLease || c.Prefix != redisdedup.DefaultPrefix {
		t.Fatalf("config %+v", c)
	}
}
