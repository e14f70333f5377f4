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
		{kerr.UnknownTopicOrPartition, false},  // a missing topic may be created: keep retrying
		{kerr.TopicAuthorizationFailed, false}, // fixed by an ACL change, not by parking
		{kgo.ErrRecordTimeout, false},
		{errors.New("dial tcp: connection refused"), false},
	}
	for _, c := range cases {
		if got := relay.IsUndeliverable(classify(c.err)); got != c.undeliverable {
			t.Errorf("classify(%v) undeliverable = %v, want %v", c.err, got, c.undeliverable)
		}
	}
	if classify(nil) != nil {
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
