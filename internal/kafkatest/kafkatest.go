// Package kafkatest gives tests a Kafka cluster: the one in KAFKA_BROKERS when set, otherwise
// an in-process kfake cluster closed at the end of the test.
package kafkatest

import (
	"crypto/rand"
	"encoding/hex"
	"os"
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceflow/onceflow/internal/embedded"
)

// Brokers returns broker addresses for the test: KAFKA_BROKERS (comma separated) when set,
// otherwise those of a new kfake cluster with the given partitions per auto-created topic.
func Brokers(t testing.TB, partitions int32) []string {
	t.Helper()
	if env := os.Getenv("KAFKA_BROKERS"); env != "" {
		return strings.Split(env, ",")
	}
	return Fake(t, partitions).Brokers()
}

// Fake always starts an in-process kfake cluster, for tests that inject broker faults with
// Cluster.ControlKey. It is closed when the test ends.
func Fake(t testing.TB, partitions int32, opts ...kfake.Opt) *embedded.Kafka {
	t.Helper()
	k, err := embedded.StartKafka(partitions, opts...)
	if err != nil {
		t.Fatalf("kafkatest: %v", err)
	}
	t.Cleanup(k.Stop)
	return k
}

// Topic returns a topic name unique to this call, so tests sharing a real cluster never read
// each other's messages.
func Topic(prefix string) string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return prefix + "-" + hex.EncodeToString(b)
}
