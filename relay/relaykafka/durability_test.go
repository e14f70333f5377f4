package relaykafka_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// lockedBuffer is a log destination the background check and the test share.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// TestDurabilityWarning: after the first acknowledged write to a topic of replication factor 1
// with min.insync.replicas=1 (a development cluster's), the sink warns once, naming both
// settings and the fix; a topic with replication factor 3 and min.insync.replicas=2 on three
// brokers gets no warning. The sink still publishes: these are warnings, not refusals.
func TestDurabilityWarning(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// A development cluster: one broker, topics auto-created with replication factor 1.
	dev := kafkatest.Fake(t, 2)
	var logs lockedBuffer
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: dev.Brokers(), Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sink.Close() }()
	topic := kafkatest.Topic("durability")
	for i := range 3 {
		errs := make([]error, 1)
		sink.Publish(ctx, []*relay.Message{{ID: int64(i + 1), EventID: "e", Topic: topic, Key: "k", Payload: []byte("x")}}, errs)
		if errs[0] != nil {
			t.Fatalf("publish %d: %v", i, errs[0])
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(logs.String(), "min.insync.replicas=1") && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	got := logs.String()
	for _, want := range []string{"level=WARN", "topic=" + topic, "replication factor 1", "min.insync.replicas=1", "set it to 2"} {
		if !strings.Contains(got, want) {
			t.Errorf("log lacks %q:\n%s", want, got)
		}
	}
	if n := strings.Count(got, "replication factor 1"); n != 1 {
		t.Errorf("the replication factor warning was logged %d times for three batches, want once:\n%s", n, got)
	}

	// A production-like topic on three brokers.
	prod := kafkatest.Fake(t, 3, kfake.NumBrokers(3))
	cl, err := kgo.NewClient(kgo.SeedBrokers(prod.Brokers()...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	two := "2"
	good := kafkatest.Topic("durable")
	if _, err := kadm.NewClient(cl).CreateTopic(ctx, 3, 3, map[string]*string{"min.insync.replicas": &two}, good); err != nil {
		t.Fatal(err)
	}
	psink, err := relaykafka.NewSink(relaykafka.Config{Brokers: prod.Brokers()})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = psink.Close() }()
	warns, err := psink.CheckDurability(ctx, good, "missing-topic")
	if err != nil {
		t.Fatal(err)
	}
	if len(warns) != 1 || !strings.Contains(warns[0], "missing-topic does not exist") {
		t.Fatalf("warnings %q, want exactly one, for the missing topic", warns)
	}
}
