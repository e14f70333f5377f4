package relay_test

import (
	"encoding/json"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// TestFailureSummary: a relay that keeps failing to publish logs the first failure at once,
// then one warning per FailureLogInterval that says what fails (topic, error, count) and the
// age of the oldest failing row, and the recovery — not one line per failed batch (before: a
// warning per batch without the row's age, and per-row retries at debug only).
func TestFailureSummary(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	k := kafkatest.Fake(t, 1)
	brokers := k.Brokers()
	topic := kafkatest.Topic("summary")
	c := newConsumer(t, brokers, topic)
	var logs testutil.SyncBuffer
	rec := newRecorder()
	r := newKafkaRelayWith(t, db, relaykafka.Config{Brokers: brokers, DeliveryTimeout: time.Second, Opts: fastRetries},
		relay.Config{Metrics: rec, RetryBackoff: 20 * time.Millisecond, MaxRetryBackoff: 60 * time.Millisecond,
			FailureLogInterval: 500 * time.Millisecond,
			Logger:             slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))})
	var down atomic.Bool
	down.Store(true)
	k.Cluster.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		k.Cluster.KeepControl()
		if !down.Load() {
			return nil, nil, false
		}
		return produceErrorResponse(req.(*kmsg.ProduceRequest), kerr.ClusterAuthorizationFailed.Code), nil, true
	})
	want := writeEvents(t, db, topic, 40, 4, 10)
	startRelay(t, r)
	rec.waitFor(t, 30*time.Second, "the first failed batch", func(r *recorder) bool { return r.failCalls > 0 })
	time.Sleep(2500 * time.Millisecond) // the outage: five summary windows
	down.Store(false)
	got := c.waitDistinct(t, len(want), 30*time.Second)
	checkDelivery(t, want, got)
	eventually(t, 10*time.Second, "the recovery logged", func() bool { return strings.Contains(logs.String(), "publishing recovered") })

	rec.mu.Lock()
	calls := rec.failCalls
	rec.mu.Unlock()
	var warns, summaries int
	for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		var e map[string]any
		if err := json.Unmarshal([]byte(line), &e); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if e["level"] != "WARN" || !strings.Contains(e["msg"].(string), "publishing") {
			continue
		}
		warns++
		if e["msg"] == "relay: publishing keeps failing" {
			summaries++
			cause, _ := e["cause1"].(map[string]any)
			if cause["topic"] != topic || !strings.Contains(cause["err"].(string), "CLUSTER_AUTHORIZATION_FAILED") || cause["count"].(float64) < 1 {
				t.Errorf("summary without topic, error or count: %s", line)
			}
			if _, ok := e["oldest_failing_row_age"]; !ok {
				t.Errorf("summary without the oldest failing row's age: %s", line)
			}
		}
	}
	t.Logf("%d failed publish calls, %d warnings (%d summaries)", calls, warns, summaries)
	if summaries == 0 {
		t.Fatalf("no summary in 2.5s of failures:\n%s", logs.String())
	}
	if warns > 8 || warns >= calls {
		t.Fatalf("%d warnings for %d failed publish calls in 2.5s with a 500ms summary interval: not rate-limited", warns, calls)
	}
}
