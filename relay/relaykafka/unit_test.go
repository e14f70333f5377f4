package relaykafka

import (
	"errors"
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/relay"
)

func TestClassify(t *testing.T) {
	cases := []struct {
		err           error
		undeliverable bool
	}{
		{kerr.MessageTooLarge, true},
		{kerr.InvalidRecord, true},
		{kerr.CorruptMessage, true},
		{kerr.RecordListTooLarge, true},
		{kerr.NotLeaderForPartition, false},
		{kerr.RequestTimedOut, false},
		{kerr.UnknownTopicOrPartition, true},  // the topic as a whole (relay.TopicError)
		{kerr.TopicAuthorizationFailed, true}, // likewise: a missing ACL
		{kgo.ErrRecordTimeout, false},
		{errors.New("dial tcp: connection refused"), false},
	}
	for _, c := range cases {
		if got := relay.IsUndeliverable(classify(c.err, "t")); got != c.undeliverable {
			t.Errorf("classify(%v) undeliverable = %v, want %v", c.err, got, c.undeliverable)
		}
	}
	if classify(nil, "t") != nil {
		t.Fatal("nil error classified as a failure")
	}
}

func TestVarintLen(t *testing.T) {
	for _, c := range []struct{ v, n int }{{0, 1}, {-1, 1}, {63, 1}, {64, 2}, {-65, 2}, {8191, 2}, {8192, 3}, {1 << 20, 4}} {
		if got := varintLen(c.v); got != c.n {
			t.Errorf("varintLen(%d) = %d, want %d", c.v, got, c.n)
		}
	}
}

func TestValidTopic(t *testing.T) {
	for _, ok := range []string{"orders", "orders.placed", "a_b-c.D9", strings.Repeat("t", 249)} {
		if err := validTopic(ok); err != nil {
			t.Errorf("validTopic(%q) = %v", ok, err)
		}
	}
	for _, bad := range []string{"", ".", "..", "with space", "ümlaut", "a/b", strings.Repeat("t", 250)} {
		if err := validTopic(bad); !errors.Is(err, ErrInvalidTopic) {
			t.Errorf("validTopic(%q) = %v, want ErrInvalidTopic", bad, err)
		}
	}
}

// A whole-topic refusal names its topic, so the relay can stop sending that topic alone.
func TestClassifyTopicRefusal(t *testing.T) {
	for _, e := range []error{kerr.UnknownTopicOrPartition, kerr.TopicAuthorizationFailed} {
		var te *relay.TopicError
		if err := classify(e, "orders"); !errors.As(err, &te) || te.Topic != "orders" || !errors.Is(err, e) {
			t.Errorf("classify(%v) = %v, want a relay.TopicError for topic orders wrapping it", e, err)
		}
	}
	var te *relay.TopicError
	if errors.As(classify(kerr.MessageTooLarge, "orders"), &te) {
		t.Error("a per-message refusal classified as a topic refusal")
	}
}
