package inboxkafka_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/outbox"
)

// restartChildEnv selects the consumer mode of this test binary (see init); the other
// RESTART_* variables carry its settings.
const restartChildEnv = "ONCEFLOW_INBOXKAFKA_TEST_CHILD"

// The test shortens the session (kfake allows it with GroupMinSessionTimeout) so that a
// killed member is noticed in seconds; the rebalance and read timeouts are SaramaConfig's.
const (
	testSession   = 3 * time.Second
	testHeartbeat = time.Second
)

// init runs the consumer child before the testing package starts, so that child mode needs
// no change to TestMain.
func init() {
	if os.Getenv(restartChildEnv) != "" {
		os.Exit(restartChild())
	}
}

// restartChild is a consumer process: a watermill-kafka subscriber with SaramaConfig's
// settings under a router, printing "RUNNING" once the router runs and "DONE <uuid>" after
// each handled message (before the router acks it, so a message printed by a killed child may
// come again). Its sarama client id, RESTART_CLIENT, names it in the group's member list.
func restartChild() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "child:", err); return 1 }
	cfg := inboxkafka.SubscriberConfig(strings.Split(os.Getenv("RESTART_BROKERS"), ","), os.Getenv("RESTART_GROUP"))
	sc := cfg.OverwriteSaramaConfig
	sc.ClientID = os.Getenv("RESTART_CLIENT")
	sc.Consumer.Group.Session.Timeout = testSession
	sc.Consumer.Group.Heartbeat.Interval = testHeartbeat
	if id := os.Getenv("RESTART_INSTANCE"); id != "" {
		sc.Consumer.Group.InstanceId = id
	}
	// sarama's own log (joins, rebalances, errors) goes to stderr, which the test prints when
	// it fails.
	sarama.Logger = log.New(os.Stderr, "sarama: ", log.Lmicroseconds)
	wlog := watermill.NewSlogLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	sub, err := kafka.NewSubscriber(cfg, wlog)
	if err != nil {
		return fail(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, wlog)
	if err != nil {
		return fail(err)
	}
	var mu sync.Mutex
	router.AddConsumerHandler("restart-test", os.Getenv("RESTART_TOPIC"), sub, func(msg *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		fmt.Fprintln(os.Stdout, "DONE", msg.UUID)
		return nil
	})
	go func() {
		select {
		case <-router.Running():
			mu.Lock()
			fmt.Fprintln(os.Stdout, "RUNNING")
			mu.Unlock()
		case <-ctx.Done():
		}
	}()
	if err := router.Run(ctx); err != nil {
		return fail(err)
	}
	return 0
}

// restartChildProc is a running consumer child; every DONE line goes to seen.
type restartChildProc struct {
	client  string
	cmd     *exec.Cmd
	running chan struct{}
	done    chan string // each DONE uuid, without blocking the reader (buffered, dropped when full)
	stderr  *testutil.SyncBuffer
	exited  chan struct{}
}

// consumed is the set of message ids the children reported handled.
type consumed struct {
	mu   sync.Mutex
	seen map[string]int
	more chan struct{} // signalled after each new id
}

func (c *consumed) add(id string) {
	c.mu.Lock()
	c.seen[id]++
	c.mu.Unlock()
	select {
	case c.more <- struct{}{}:
	default:
	}
}

func (c *consumed) missing(ids []string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, id := range ids {
		if c.seen[id] == 0 {
			n++
		}
	}
	return n
}

func startRestartChild(t *testing.T, env []string, client string, got *consumed) *restartChildProc {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(append(os.Environ(), restartChildEnv+"=consumer", "RESTART_CLIENT="+client), env...)
	// An io.Pipe rather than StdoutPipe: Wait then finishes copying before it returns, so no
	// line printed just before a SIGKILL is lost.
	stdout, pw := io.Pipe()
	cmd.Stdout = pw
	c := &restartChildProc{client: client, cmd: cmd, running: make(chan struct{}), done: make(chan string, 1),
		stderr: &testutil.SyncBuffer{}, exited: make(chan struct{})}
	cmd.Stderr = c.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			line := sc.Text()
			switch {
			case line == "RUNNING":
				close(c.running)
			case strings.HasPrefix(line, "DONE "):
				id := strings.TrimPrefix(line, "DONE ")
				got.add(id)
				select {
				case c.done <- id:
				default:
				}
			}
		}
		_, _ = io.Copy(io.Discard, stdout)
	}()
	go func() { _ = cmd.Wait(); pw.Close(); close(c.exited) }()
	t.Cleanup(func() {
		select {
		case <-c.exited:
		default:
			_ = cmd.Process.Kill() // only the process this test started
			<-c.exited
		}
	})
	return c
}

// kill SIGKILLs the child (a crash: no LeaveGroup, no offset commit) and waits for it to exit.
func (c *restartChildProc) kill(t *testing.T) {
	t.Helper()
	_ = c.cmd.Process.Signal(syscall.SIGKILL) // only the process this test started
	select {
	case <-c.exited:
	case <-time.After(time.Minute):
		t.Fatalf("child %s did not exit after SIGKILL", c.client)
	}
}

// wait waits until ch is closed (the child handled a message, or became RUNNING: what).
func (c *restartChildProc) wait(t *testing.T, what string, ch <-chan struct{}, deadline time.Duration, group func() string) {
	t.Helper()
	select {
	case <-ch:
	case <-c.exited:
		t.Fatalf("child %s exited before %s; group: %s; stderr:\n%s", c.client, what, group(), c.stderr.String())
	case <-time.After(deadline):
		t.Fatalf("child %s: no %s within %v; group: %s; stderr:\n%s", c.client, what, deadline, group(), c.stderr.String())
	}
}

// reaper works around kfake's group coordinator: when a member's connection died while the
// coordinator owed it a JoinGroup or SyncGroup reply, kfake drops the reply without
// restarting the member's session timer, so only the rebalance timeout removes it (and every
// rejoin of the others restarts that timeout). A real broker removes such a member once its
// session timeout passed. The reaper does what the broker would have done: a member whose
// process was killed more than a session timeout (plus a second) ago and is still in the
// group is removed with a LeaveGroup on its behalf. It counts how often that was needed.
type reaper struct {
	adm    *kadm.Client
	cl     *kgo.Client
	group  string
	mu     sync.Mutex
	killed map[string]time.Time // client id -> when its process was killed
	reaped int
}

func (r *reaper) markKilled(client string) {
	r.mu.Lock()
	r.killed[client] = time.Now()
	r.mu.Unlock()
}

func (r *reaper) run(ctx context.Context, t *testing.T) {
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		groups, err := r.adm.DescribeGroups(ctx, r.group)
		if err != nil {
			continue
		}
		for _, m := range groups[r.group].Members {
			r.mu.Lock()
			at, dead := r.killed[m.ClientID]
			r.mu.Unlock()
			if !dead || time.Since(at) < testSession+time.Second {
				continue
			}
			req := kmsg.NewPtrLeaveGroupRequest()
			req.Group = r.group
			lm := kmsg.NewLeaveGroupRequestMember()
			lm.MemberID = m.MemberID
			req.Members = append(req.Members, lm)
			if _, err := req.RequestWith(ctx, r.cl); err == nil {
				t.Logf("kfake workaround: removed member %s of %s, killed %v ago and still in the group", m.MemberID, m.ClientID, time.Since(at).Round(time.Millisecond))
				r.mu.Lock()
				r.reaped++
				r.mu.Unlock()
			}
		}
	}
}

// killWhileJoining waits until c is a member of group while the group is still
// PreparingRebalance (c sent JoinGroup and waits for the other members to rejoin) and reports
// whether it saw that state; the caller then SIGKILLs c. It gives up when c has been assigned
// partitions (the rebalance completed first) or after 30 s.
func killWhileJoining(ctx context.Context, t *testing.T, adm *kadm.Client, group string, c *restartChildProc) bool {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		groups, err := adm.DescribeGroups(ctx, group)
		if err == nil {
			g := groups[group]
			for _, m := range g.Members {
				if m.ClientID != c.client {
					continue
				}
				if g.State == "PreparingRebalance" {
					return true
				}
				if a, ok := m.Assigned.AsConsumer(); ok && len(a.Topics) > 0 {
					return false
				}
			}
		}
		select {
		case <-time.After(10 * time.Millisecond): // polling the coordinator: there is no signal to await
		case <-c.exited:
			return false
		case <-ctx.Done():
			return false
		}
	}
	return false
}

// Consumers SIGKILLed at any point — while consuming, or while they wait in JoinGroup — and
// restarted under new member ids (a rescheduled pod) must not leave
// partitions unowned: every message is handled, and the group ends Stable with exactly the
// live consumers, every partition assigned and no lag, within a bound. With sarama's default
// timeouts (read 30 s below rebalance 60 s) live consumers waiting in JoinGroup time out and
// rejoin, restarting the rebalance; SaramaConfig's agree (see the package documentation).
func TestConsumersKilledAndRestartedUnderNewMemberIDs(t *testing.T) {
	t.Parallel()
	const partitions, perBatch, live = 4, 50, 2
	k := kafkatest.Fake(t, partitions, kfake.GroupMinSessionTimeout(time.Second))
	topic, group := kafkatest.Topic("commands"), kafkatest.Topic("participant")
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	cl, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers()...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	if _, err := adm.CreateTopic(ctx, partitions, 1, nil, topic); err != nil {
		t.Fatal(err)
	}
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: k.Brokers(), Marshaler: kafka.DefaultMarshaler{}}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	var published []string
	publish := func() {
		t.Helper()
		for range perBatch {
			msg := outbox.NewMessage([]byte(`{}`))
			if err := pub.Publish(topic, msg); err != nil {
				t.Fatal(err)
			}
			published = append(published, msg.UUID)
		}
	}

	got := &consumed{seen: map[string]int{}, more: make(chan struct{}, 1)}
	env := []string{"RESTART_BROKERS=" + strings.Join(k.Brokers(), ","), "RESTART_GROUP=" + group, "RESTART_TOPIC=" + topic}
	r := &reaper{adm: adm, cl: cl, group: group, killed: map[string]time.Time{}}
	rctx, stopReaper := context.WithCancel(ctx)
	var rwg sync.WaitGroup
	rwg.Add(1)
	go func() { defer rwg.Done(); r.run(rctx, t) }()
	defer func() { stopReaper(); rwg.Wait() }()

	describe := func() string {
		dctx, dcancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer dcancel()
		lags, err := adm.Lag(dctx, group)
		if err != nil {
			return err.Error()
		}
		l := lags[group]
		var b strings.Builder
		fmt.Fprintf(&b, "state %s", l.State)
		for _, m := range l.Members {
			fmt.Fprintf(&b, "; member %s (%s)", m.MemberID, m.ClientID)
			if a, ok := m.Assigned.AsConsumer(); ok {
				for _, tp := range a.Topics {
					fmt.Fprintf(&b, " partitions %v", tp.Partitions)
				}
			}
		}
		for _, pl := range l.Lag.Sorted() {
			fmt.Fprintf(&b, "; p%d lag %d", pl.Partition, pl.Lag)
		}
		return b.String()
	}
	n := 0
	start := func() *restartChildProc {
		n++
		return startRestartChild(t, env, fmt.Sprintf("consumer-%d", n), got)
	}
	kill := func(c *restartChildProc) {
		c.kill(t)
		r.markKilled(c.client)
	}
	firstDone := func(c *restartChildProc) chan struct{} {
		ch := make(chan struct{})
		go func() {
			select {
			case <-c.done:
			case <-c.exited:
			}
			close(ch)
		}()
		return ch
	}

	children := make([]*restartChildProc, live)
	for i := range children {
		children[i] = start()
	}
	for _, c := range children {
		c.wait(t, "RUNNING", c.running, time.Minute, describe)
	}
	publish()
	for round := range 4 {
		victim := children[round%live]
		// Drain what the victim reported so far, then wait for one more handled message: it
		// is killed mid-stream, with messages in flight and offsets not yet committed.
		// The victim may own no partition yet (it is still joining) or have drained its own:
		// publish batches until it handles one of them.
		for len(victim.done) > 0 {
			<-victim.done
		}
		handled := firstDone(victim)
		for deadline := time.Now().Add(time.Minute); ; {
			publish()
			select {
			case <-handled:
			case <-time.After(time.Second): // then publish more: its partitions may have had none
				if time.Now().Before(deadline) {
					continue
				}
				victim.wait(t, "message", handled, 0, describe)
			}
			break
		}
		kill(victim)
		if round%2 == 1 {
			// A consumer killed while it waits in JoinGroup for the others to rejoin: the
			// coordinator's reply to it then fails, and the next rebalance (the replacement
			// joining) waits for a member that will never come.
			killedJoining := false
			for attempt := 0; attempt < 5 && !killedJoining; attempt++ {
				doomed := start()
				killedJoining = killWhileJoining(ctx, t, adm, group, doomed)
				kill(doomed)
			}
			if !killedJoining {
				t.Log("no consumer could be killed while joining in 5 attempts; killed after it started")
			}
		}
		children[round%live] = start() // a new process, so a new member id
	}
	restarted := time.Now()
	publish()

	// Every message is handled (at least once: a killed child's unacked messages come again).
	for got.missing(published) > 0 {
		select {
		case <-got.more:
		case <-ctx.Done():
			t.Fatalf("%d of %d messages never handled; group: %s", got.missing(published), len(published), describe())
		}
	}
	allHandled := time.Since(restarted)

	// The group settles: Stable, exactly the live consumers, every partition assigned, no lag.
	liveClients := map[string]bool{}
	for _, c := range children {
		liveClients[c.client] = true
	}
	const bound = 2 * inboxkafka.RebalanceTimeout
	var last string
	settled := false
	for !settled {
		lags, err := adm.Lag(ctx, group)
		if err == nil {
			l := lags[group]
			assigned, members := 0, map[string]bool{}
			for _, m := range l.Members {
				members[m.ClientID] = true
				if a, ok := m.Assigned.AsConsumer(); ok {
					for _, tp := range a.Topics {
						assigned += len(tp.Partitions)
					}
				}
			}
			total := l.Lag.Total()
			last = fmt.Sprintf("state %s, members %v, %d partitions assigned, lag %d", l.State, members, assigned, total)
			settled = l.Error() == nil && l.State == "Stable" && len(members) == len(liveClients) && assigned == partitions && total == 0
			for c := range members {
				settled = settled && liveClients[c]
			}
		}
		if settled {
			break
		}
		if time.Since(restarted) > bound {
			var logs strings.Builder
			for _, c := range children {
				lines := strings.Split(c.stderr.String(), "\n")
				fmt.Fprintf(&logs, "\n--- %s (last lines of stderr):\n%s", c.client, strings.Join(lines[max(0, len(lines)-30):], "\n"))
			}
			t.Fatalf("group did not settle within %v of the last restart: %s; group: %s%s", bound, last, describe(), logs.String())
		}
		select {
		case <-time.After(200 * time.Millisecond): // polling the coordinator: there is no signal to await
		case <-ctx.Done():
			t.Fatalf("group did not settle: %s", last)
		}
	}
	t.Logf("%d messages, %d kills: all handled %v and group settled %v after the last restart (%s); kfake workaround needed %d times",
		len(published), n-live, allHandled.Round(time.Millisecond), time.Since(restarted).Round(time.Millisecond), last, r.reaped)

	for _, c := range children {
		_ = c.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-c.exited:
		case <-time.After(time.Minute):
			t.Fatalf("child %s did not stop after SIGTERM", c.client)
		}
	}
}
