package relaykafka

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
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

// NewSink refuses Opts that would break the guarantees on a real cluster, naming the option
// and the fix, and accepts those that do not touch producing semantics.
func TestRequiredProducerSettings(t *testing.T) {
	cases := []struct {
		name string
		opts []kgo.Opt
		want []string // substrings, one per expected problem; none: accepted
	}{
		{"no options", nil, nil},
		{"unrelated options", []kgo.Opt{kgo.DialTimeout(time.Second), kgo.MetadataMinAge(time.Second)}, nil},
		{"acks=all spelled out", []kgo.Opt{kgo.RequiredAcks(kgo.AllISRAcks())}, nil},
		{"acks=1", []kgo.Opt{kgo.RequiredAcks(kgo.LeaderAck())}, []string{"kgo.RequiredAcks(kgo.LeaderAck(), acks=1)"}},
		{"acks=0", []kgo.Opt{kgo.RequiredAcks(kgo.NoAck())}, []string{"kgo.RequiredAcks(kgo.NoAck(), acks=0)"}},
		{"idempotence disabled", []kgo.Opt{kgo.DisableIdempotentWrite()}, []string{"kgo.DisableIdempotentWrite()"}},
		{"idempotence disabled, acks=1", []kgo.Opt{kgo.DisableIdempotentWrite(), kgo.RequiredAcks(kgo.LeaderAck())},
			[]string{"kgo.DisableIdempotentWrite()", "acks=1"}},
		{"idempotence disabled, 5 in flight", []kgo.Opt{kgo.DisableIdempotentWrite(), kgo.MaxProduceRequestsInflightPerBroker(5)},
			[]string{"kgo.DisableIdempotentWrite()"}},
		{"idempotence disabled, 6 in flight", []kgo.Opt{kgo.DisableIdempotentWrite(), kgo.MaxProduceRequestsInflightPerBroker(6)},
			[]string{"kgo.DisableIdempotentWrite()", "kgo.MaxProduceRequestsInflightPerBroker(6)"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			sink, err := NewSink(Config{Brokers: []string{"127.0.0.1:9"}, Opts: c.opts})
			if len(c.want) == 0 {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				_ = sink.Close()
				return
			}
			var ce *relay.ConfigError
			if !errors.As(err, &ce) {
				if sink != nil {
					_ = sink.Close()
				}
				t.Fatalf("got %v, want a *relay.ConfigError", err)
			}
			if len(ce.Problems) != len(c.want) {
				t.Fatalf("%d problems, want %d: %v", len(ce.Problems), len(c.want), err)
			}
			for i, w := range c.want {
				if msg := ce.Problems[i].Error(); !strings.Contains(msg, w) || !strings.Contains(msg, "remove the option") {
					t.Errorf("problem %d = %q, want it to name %q and say to remove the option", i, msg, w)
				}
			}
		})
	}
	// Every problem at once, with the others.
	_, err := NewSink(Config{Opts: []kgo.Opt{kgo.RequiredAcks(kgo.LeaderAck())}})
	var ce *relay.ConfigError
	if !errors.As(err, &ce) || len(ce.Problems) != 2 {
		t.Fatalf("got %v, want two problems (no brokers, acks)", err)
	}
}

func TestCheckSaramaProducer(t *testing.T) {
	good := func() *sarama.Config {
		c := sarama.NewConfig()
		c.Producer.RequiredAcks = sarama.WaitForAll
		c.Producer.Idempotent = true
		c.Net.MaxOpenRequests = 1
		return c
	}
	cases := []struct {
		name   string
		change func(*sarama.Config)
		want   []string
	}{
		{"required settings", func(*sarama.Config) {}, nil},
		{"acks=1", func(c *sarama.Config) { c.Producer.RequiredAcks = sarama.WaitForLocal }, []string{"RequiredAcks is 1"}},
		{"not idempotent", func(c *sarama.Config) { c.Producer.Idempotent = false }, []string{"Idempotent is false"}},
		{"6 in flight", func(c *sarama.Config) { c.Producer.Idempotent = false; c.Net.MaxOpenRequests = 6 },
			[]string{"Idempotent is false", "MaxOpenRequests is 6"}},
	}
	for _, c := range cases {
		cfg := good()
		c.change(cfg)
		err := CheckSaramaProducer(cfg)
		var ce *relay.ConfigError
		if len(c.want) == 0 {
			if err != nil {
				t.Errorf("%s: %v", c.name, err)
			}
			continue
		}
		if !errors.As(err, &ce) || len(ce.Problems) != len(c.want) {
			t.Errorf("%s: got %v, want %d problems", c.name, err, len(c.want))
			continue
		}
		for i, w := range c.want {
			if !strings.Contains(ce.Problems[i].Error(), w) {
				t.Errorf("%s: problem %q lacks %q", c.name, ce.Problems[i], w)
			}
		}
	}
	if err := CheckSaramaProducer(nil); err == nil {
		t.Error("sarama's defaults (acks from the leader, no idempotence) passed")
	}
}
