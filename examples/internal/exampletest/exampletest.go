// Package exampletest runs an example service as a real process in a test: built once,
// started on the test's PostgreSQL (a fresh database from onceflowtest, the service's tables
// in a schema of its own) and Kafka, stopped with SIGTERM.
package exampletest

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/examples/internal/platform"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// Service is a running example process.
type Service struct {
	Addr    string           // its HTTP address
	DB      *onceflowtest.DB // the test's database; the service's tables are in Schema
	Schema  string           // the service's schema in DB (its name)
	Brokers []string         // the Kafka it uses
	Prefix  string           // its topic prefix, unique to the test
	cmd     *exec.Cmd
	out     *syncBuffer
	exited  chan struct{}
}

// Table qualifies a table of the service's schema, for the test's own queries on DB.Pool.
func (s *Service) Table(name string) string { return pgx.Identifier{s.Schema, name}.Sanitize() }

// build compiles pkg into the test's temporary directory. Each example has one test, so a
// test process builds its binary once.
func build(t *testing.T, pkg string) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), filepath.Base(pkg))
	if out, err := exec.Command("go", "build", "-o", bin, pkg).CombinedOutput(); err != nil {
		t.Fatalf("build %s: %v\n%s", pkg, err, out)
	}
	return bin
}

// Start builds pkg, runs it with its in-process relay on a fresh schema and the test's
// Kafka, and waits until it answers /healthz. The process is stopped (SIGKILL) at the end of
// the test if Stop was not called.
func Start(t *testing.T, pkg string, args ...string) *Service {
	t.Helper()
	bin := build(t, pkg)
	s := &Service{DB: onceflowtest.NewDB(t), Schema: filepath.Base(pkg), out: &syncBuffer{}, exited: make(chan struct{})}
	s.Brokers = onceflowtest.NewKafka(t, onceflowtest.KafkaOptions{Partitions: platform.Partitions}).Brokers
	s.Prefix = strings.ReplaceAll(s.DB.Name, "_", "-") + "." // the database name is unique
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s.Addr = l.Addr().String()
	l.Close()
	s.cmd = exec.Command(bin, append([]string{"-addr", s.Addr, "-schema", s.Schema, "-topic-prefix", s.Prefix,
		"-instance", "test", "-log-level", "warn"}, args...)...)
	s.cmd.Env = append(os.Environ(), "DATABASE_URL="+s.DB.DatabaseURL, "KAFKA_BROKERS="+strings.Join(s.Brokers, ","))
	s.cmd.Stdout, s.cmd.Stderr = s.out, s.out
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = s.cmd.Wait(); close(s.exited) }()
	t.Cleanup(func() {
		_ = s.cmd.Process.Kill()
		<-s.exited
		if t.Failed() {
			t.Logf("output of %s:\n%s", pkg, s.out.String())
		}
	})
	for deadline := time.Now().Add(30 * time.Second); ; {
		if resp, err := http.Get("http://" + s.Addr + "/healthz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return s
			}
		}
		select {
		case <-s.exited:
			t.Fatalf("%s exited during start-up:\n%s", pkg, s.out.String())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not healthy after 30s:\n%s", pkg, s.out.String())
		}
	}
}

// Stop sends SIGTERM and fails the test unless the process exits with status 0 within 15 s.
func (s *Service) Stop(t *testing.T) {
	t.Helper()
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.exited:
	case <-time.After(15 * time.Second):
		t.Fatalf("no exit within 15s of SIGTERM:\n%s", s.out.String())
	}
	if code := s.cmd.ProcessState.ExitCode(); code != 0 {
		t.Fatalf("exit status %d after SIGTERM:\n%s", code, s.out.String())
	}
}

// Do sends a request to the service with the given headers and returns status, headers and
// body.
func (s *Service) Do(t *testing.T, method, path, body string, headers ...string) (int, http.Header, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, "http://"+s.Addr+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var b bytes.Buffer
	_, _ = b.ReadFrom(resp.Body)
	return resp.StatusCode, resp.Header, b.String()
}

// Produce sends msg to topic as the relay would: the UUID in the _watermill_message_uuid
// header, metadata as headers, the partition key as the record key.
func (s *Service) Produce(t *testing.T, topic string, msg *message.Message) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(s.Brokers...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	rec := &kgo.Record{Topic: topic, Value: msg.Payload, Key: []byte(outbox.PartitionKey(msg)),
		Headers: []kgo.RecordHeader{{Key: relaykafka.UUIDHeader, Value: []byte(msg.UUID)}}}
	for k, v := range msg.Metadata {
		rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: k, Value: []byte(v)})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := cl.ProduceSync(ctx, rec).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

// Await reads topic from the start until a record carries every header in want, and returns
// it; it fails the test after 20 s.
func (s *Service) Await(t *testing.T, topic string, want map[string]string) *kgo.Record {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(s.Brokers...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("no record with %v on %s within 20s:\n%s", want, topic, s.out.String())
		}
		var found *kgo.Record
		fs.EachRecord(func(r *kgo.Record) {
			for k, v := range want {
				if Header(r, k) != v {
					return
				}
			}
			found = r
		})
		if found != nil {
			return found
		}
	}
}

// Command returns a saga command as the orchestrator of saga "checkout" sends it: payload
// cmd (JSON), the saga metadata of ref, keyed by the saga id, answered on replyTo.
func Command(t *testing.T, ref outbox.SagaRef, replyTo string, cmd any) *message.Message {
	t.Helper()
	payload, err := json.Marshal(cmd)
	if err != nil {
		t.Fatal(err)
	}
	msg := outbox.SetPartitionKey(outbox.NewMessage(payload), ref.ID)
	outbox.SetSaga(msg, ref)
	msg.Metadata.Set(outbox.MetadataSagaName, "checkout")
	msg.Metadata.Set(outbox.MetadataSagaReplyTo, replyTo)
	return msg
}

// Header returns the value of a record's header.
func Header(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// syncBuffer is a bytes.Buffer safe for one writer goroutine (the child process's output
// copier) and concurrent readers (the test printing it on failure).
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
