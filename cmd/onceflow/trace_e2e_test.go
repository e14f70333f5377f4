package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/outbox"
)

// traceChildEnv, when set in a test binary's environment, makes TestTraceChildRelay run
// `onceflow relay` (the CLI's own code path, args from traceChildArgs) with an OpenTelemetry
// SDK installed as the global provider, exporting every span as one JSON line to the file
// the variable names: the collector stand-in.
const (
	traceChildEnv  = "ONCEFLOW_TEST_TRACE_SPANS"
	traceChildArgs = "ONCEFLOW_TEST_TRACE_ARGS"
)

// jsonSpan is one exported span as the child writes it.
type jsonSpan struct {
	Name    string            `json:"name"`
	Kind    string            `json:"kind"`
	TraceID string            `json:"trace_id"`
	SpanID  string            `json:"span_id"`
	Parent  string            `json:"parent_span_id"`
	Links   []jsonLink        `json:"links"`
	Attrs   map[string]string `json:"attributes"`
}

type jsonLink struct {
	TraceID string `json:"trace_id"`
	SpanID  string `json:"span_id"`
}

func toJSONSpan(s sdktrace.ReadOnlySpan) jsonSpan {
	js := jsonSpan{Name: s.Name(), Kind: s.SpanKind().String(), TraceID: s.SpanContext().TraceID().String(),
		SpanID: s.SpanContext().SpanID().String(), Attrs: map[string]string{}}
	if s.Parent().IsValid() {
		js.Parent = s.Parent().SpanID().String()
	}
	for _, l := range s.Links() {
		js.Links = append(js.Links, jsonLink{TraceID: l.SpanContext.TraceID().String(), SpanID: l.SpanContext.SpanID().String()})
	}
	for _, a := range s.Attributes() {
		js.Attrs[string(a.Key)] = a.Value.Emit()
	}
	return js
}

// fileExporter is the test-only exporter of the child: JSON lines, one per span, synced at
// once so the parent reads them while the child still runs.
type fileExporter struct {
	mu sync.Mutex
	f  *os.File
}

func (e *fileExporter) ExportSpans(_ context.Context, spans []sdktrace.ReadOnlySpan) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, s := range spans {
		b, err := json.Marshal(toJSONSpan(s))
		if err != nil {
			return err
		}
		if _, err := e.f.Write(append(b, '\n')); err != nil {
			return err
		}
	}
	return e.f.Sync()
}

func (e *fileExporter) Shutdown(context.Context) error { return e.f.Close() }

// TestTraceChildRelay is the child process of TestOneTraceAcrossProcesses; it skips when run
// as a test.
func TestTraceChildRelay(t *testing.T) {
	path := os.Getenv(traceChildEnv)
	if path == "" {
		t.Skip("the child process of TestOneTraceAcrossProcesses")
	}
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(&fileExporter{f: f}))
	otel.SetTracerProvider(tp) // the relay gets no provider: it must use the global one
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	var args []string
	if err := json.Unmarshal([]byte(os.Getenv(traceChildArgs)), &args); err != nil {
		t.Fatal(err)
	}
	code := run(ctx, args, os.Getenv, os.Stdout, os.Stderr)
	if err := tp.Shutdown(context.Background()); err != nil {
		t.Error(err)
	}
	if code != 0 {
		t.Fatalf("onceflow relay exited %d", code)
	}
}

// TestOneTraceAcrossProcesses proves that one trace runs from an HTTP request through the
// outbox, `onceflow relay` in another process, Kafka (kfake) and the inbox to the handler:
// client → server span (+ idempotency outcome) → `create` (outbox write) → `process`
// (inbox, parent = `create`, read back from the Kafka headers) → the handler's span; and
// the relay's `send` span, exported by the child to a file, links to `create`.
func TestOneTraceAcrossProcesses(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	db := testdb.New(t)
	brokers := kafkatest.Brokers(t, 1)
	topic := kafkatest.Topic("traced")

	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	tracer := tp.Tracer("test")
	prop := propagation.TraceContext{}

	// The producing service: server span (what otelhttp would start), idempotency middleware,
	// a handler writing one event to the outbox in the request's transaction.
	writer, err := outbox.NewWriter(outbox.Config{Schema: db.Schema, TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	idem, err := idempotency.New(idempotency.Config{Pool: db.Pool, Schema: db.Schema,
		Owner: func(*http.Request) (string, error) { return "tester", nil }})
	if err != nil {
		t.Fatal(err)
	}
	var event *message.Message
	create := idem.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		event = outbox.NewMessage([]byte(`{"order":1}`))
		outbox.SetPartitionKey(event, "order-1")
		if err := writer.WriteTx(r.Context(), outbox.MustTx(r.Context()), topic, event); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sctx, span := tracer.Start(prop.Extract(r.Context(), propagation.HeaderCarrier(r.Header)), "POST /orders",
			trace.WithSpanKind(trace.SpanKindServer))
		defer span.End()
		create.ServeHTTP(w, r.WithContext(sctx))
	}))
	defer srv.Close()

	// The client's span is the root of the trace.
	cctx, client := tracer.Start(ctx, "client", trace.WithSpanKind(trace.SpanKindClient))
	req, _ := http.NewRequestWithContext(cctx, http.MethodPost, srv.URL+"/orders", strings.NewReader("x"))
	req.Header.Set(idempotency.HeaderKey, "order-1-key")
	prop.Inject(cctx, propagation.HeaderCarrier(req.Header))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	client.End()
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST /orders: %d", resp.StatusCode)
	}
	traceID := client.SpanContext().TraceID().String()

	// The relay: `onceflow relay` in a child process (this test binary, re-run as
	// TestTraceChildRelay), with an SDK as its global provider exporting to a file.
	spansFile := t.TempDir() + "/relay-spans.jsonl"
	args, _ := json.Marshal([]string{"relay", "--database-url", db.URL, "--schema", db.Schema,
		"--kafka-brokers", strings.Join(brokers, ","), "--id", "traced-relay"})
	child := exec.Command(os.Args[0], "-test.run=^TestTraceChildRelay$", "-test.v")
	child.Env = append(os.Environ(), traceChildEnv+"="+spansFile, traceChildArgs+"="+string(args), "GORACE=halt_on_error=1")
	var out testutil.SyncBuffer
	child.Stdout, child.Stderr = &out, &out
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	childDone := make(chan error, 1)
	go func() { childDone <- child.Wait() }()
	defer func() {
		_ = child.Process.Kill()
		<-childDone
		if t.Failed() {
			t.Logf("relay child output:\n%s", out.String())
		}
	}()

	// The consuming service: watermill-kafka subscriber, inbox middleware, a handler that
	// starts a span of its own from the context it is given.
	ib, err := inbox.New(inbox.Config{Pool: db.Pool, Schema: db.Schema, Consumer: "traced-consumer",
		TracerProvider: tp, TraceAttributes: inboxkafka.TraceAttributes})
	if err != nil {
		t.Fatal(err)
	}
	sub, err := kafka.NewSubscriber(inboxkafka.SubscriberConfig(brokers, "traced-consumer"), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	handled := make(chan struct{}, 1)
	handle := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		_, span := tracer.Start(msg.Context(), "handler")
		span.End()
		select {
		case handled <- struct{}{}:
		default:
		}
		return nil, nil
	})
	router.AddConsumerHandler("traced", topic, sub, func(msg *message.Message) error {
		_, err := handle(msg)
		return err
	})
	rctx, stopRouter := context.WithCancel(ctx)
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(rctx) }()
	defer func() { stopRouter(); <-routerDone }()

	select {
	case <-handled:
	case err := <-childDone:
		t.Fatalf("relay child exited early: %v", err)
	case <-ctx.Done():
		t.Fatal("the handler did not receive the event within 2 minutes")
	}
	_ = child.Process.Signal(syscall.SIGTERM)
	if err := <-childDone; err != nil {
		t.Fatalf("relay child: %v", err)
	}
	childDone <- nil // for the deferred cleanup

	// The parent's spans.
	spans := map[string]jsonSpan{} // by name
	for _, s := range exp.GetSpans().Snapshots() {
		spans[s.Name()] = toJSONSpan(s)
	}
	need := func(name, kind string) jsonSpan {
		s, ok := spans[name]
		if !ok {
			t.Fatalf("no span %q among %v", name, keys(spans))
		}
		if s.TraceID != traceID {
			t.Errorf("span %q is in trace %s, want the request's trace %s", name, s.TraceID, traceID)
		}
		if s.Kind != kind {
			t.Errorf("span %q has kind %s, want %s", name, s.Kind, kind)
		}
		return s
	}
	server := need("POST /orders", "server")
	createSpan := need("create "+topic, "producer")
	process := need("process "+topic, "consumer")
	handler := need("handler", "internal")
	if server.Attrs["onceflow.idempotency.outcome"] != "stored" {
		t.Errorf("server span: idempotency outcome %q, want stored", server.Attrs["onceflow.idempotency.outcome"])
	}
	if createSpan.Parent != server.SpanID {
		t.Errorf("create span's parent is %s, want the server span %s", createSpan.Parent, server.SpanID)
	}
	if process.Parent != createSpan.SpanID {
		t.Errorf("process span's parent is %s, want the create span %s (from the Kafka headers)", process.Parent, createSpan.SpanID)
	}
	if handler.Parent != process.SpanID {
		t.Errorf("handler span's parent is %s, want the process span %s", handler.Parent, process.SpanID)
	}
	for span, want := range map[*jsonSpan]map[string]string{
		&createSpan: {"messaging.system": "kafka", "messaging.destination.name": topic, "messaging.message.id": event.UUID,
			"messaging.kafka.message.key": "order-1", "messaging.operation.type": "create"},
		&process: {"messaging.system": "kafka", "messaging.destination.name": topic, "messaging.message.id": event.UUID,
			"messaging.consumer.group.name": "traced-consumer", "messaging.kafka.offset": "0",
			"messaging.kafka.message.key": "order-1", "onceflow.inbox.outcome": "processed"},
	} {
		for k, v := range want {
			if span.Attrs[k] != v {
				t.Errorf("span %q: %s = %q, want %q", span.Name, k, span.Attrs[k], v)
			}
		}
	}

	// The relay's spans, from the other process.
	send := readSpans(t, spansFile)
	s, ok := send["send "+topic]
	if !ok {
		t.Fatalf("the relay exported no span %q; it exported %v", "send "+topic, keys(send))
	}
	if s.Kind != "producer" || s.Attrs["messaging.message.id"] != event.UUID || s.Attrs["onceflow.relay.acked"] != "1" {
		t.Errorf("send span: kind %s, attributes %v", s.Kind, s.Attrs)
	}
	if len(s.Links) != 1 || s.Links[0].TraceID != traceID || s.Links[0].SpanID != createSpan.SpanID {
		t.Errorf("send span links %v, want one link to the create span %s/%s", s.Links, traceID, createSpan.SpanID)
	}
}

func readSpans(t *testing.T, path string) map[string]jsonSpan {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	spans := map[string]jsonSpan{}
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var s jsonSpan
		if err := json.Unmarshal(sc.Bytes(), &s); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		spans[s.Name] = s
	}
	if err := sc.Err(); err != nil && !errors.Is(err, os.ErrClosed) {
		t.Fatal(err)
	}
	return spans
}

func keys(m map[string]jsonSpan) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, fmt.Sprintf("%q", k))
	}
	return out
}
