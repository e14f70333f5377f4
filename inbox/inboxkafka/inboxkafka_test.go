package inboxkafka_test

import (
	"strings"
	"testing"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"

	"github.com/onceflow/onceflow/inbox/inboxkafka"
)

func TestSaramaConfig(t *testing.T) {
	c := inboxkafka.SaramaConfig()
	checks := []struct {
		name      string
		got, want any
	}{
		{"Offsets.Initial", c.Consumer.Offsets.Initial, sarama.OffsetOldest},
		{"AutoCommit.Enable", c.Consumer.Offsets.AutoCommit.Enable, true},
		{"AutoCommit.Interval", c.Consumer.Offsets.AutoCommit.Interval, inboxkafka.AutoCommitInterval},
		{"IsolationLevel", c.Consumer.IsolationLevel, sarama.ReadCommitted},
		{"Return.Errors", c.Consumer.Return.Errors, true},
		{"Session.Timeout", c.Consumer.Group.Session.Timeout, inboxkafka.SessionTimeout},
		{"Heartbeat.Interval", c.Consumer.Group.Heartbeat.Interval, inboxkafka.HeartbeatInterval},
		{"Rebalance.Timeout", c.Consumer.Group.Rebalance.Timeout, inboxkafka.RebalanceTimeout},
		{"Net.ReadTimeout", c.Net.ReadTimeout, inboxkafka.ReadTimeout},
		{"static membership possible (Version >= 2.3)", c.Version.IsAtLeast(sarama.V2_3_0_0), true},
	}
	for _, ch := range checks {
		if ch.got != ch.want {
			t.Errorf("%s = %v, want %v", ch.name, ch.got, ch.want)
		}
	}
	if err := c.Validate(); err != nil {
		t.Fatalf("sarama refuses the config: %v", err)
	}
	// The timeouts must agree (see the package documentation): a JoinGroup reply can take the
	// whole rebalance timeout, so a read timeout at or below it makes a waiting member rejoin
	// and restart the rebalance; heartbeats fit three times in a session, as Kafka advises.
	g := c.Consumer.Group
	if c.Net.ReadTimeout <= g.Rebalance.Timeout {
		t.Errorf("Net.ReadTimeout %v <= Rebalance.Timeout %v: members waiting in JoinGroup would time out and restart the rebalance", c.Net.ReadTimeout, g.Rebalance.Timeout)
	}
	if 3*g.Heartbeat.Interval > g.Session.Timeout {
		t.Errorf("Heartbeat.Interval %v is more than a third of Session.Timeout %v", g.Heartbeat.Interval, g.Session.Timeout)
	}
	// Static membership is a setting away and sarama accepts it.
	c.Consumer.Group.InstanceId = "billing-0"
	if err := c.Validate(); err != nil {
		t.Fatalf("sarama refuses an InstanceId: %v", err)
	}
	c.Consumer.Group.InstanceId = ""
	sc := inboxkafka.SubscriberConfig([]string{"localhost:9092"}, "billing")
	if err := sc.Validate(); err != nil || sc.ConsumerGroup != "billing" || sc.OverwriteSaramaConfig.Consumer.Offsets.Initial != sarama.OffsetOldest {
		t.Fatalf("SubscriberConfig = %+v (%v)", sc, err)
	}
	if _, ok := sc.Unmarshaler.(kafka.DefaultMarshaler); !ok {
		t.Fatalf("unmarshaler %T", sc.Unmarshaler)
	}
	// Each call returns its own sarama config, so tweaking one subscriber never changes another.
	if inboxkafka.SaramaConfig() == c {
		t.Fatal("SaramaConfig returned a shared value")
	}
}

func TestNewSubscriberRefusesMissingGroup(t *testing.T) {
	_, err := inboxkafka.NewSubscriber(nil, "", nil)
	if err == nil || !strings.Contains(err.Error(), "no brokers") || !strings.Contains(err.Error(), "consumer group is empty") {
		t.Fatalf("err = %v, want both problems", err)
	}
	sub, err := inboxkafka.NewSubscriber([]string{"127.0.0.1:1"}, "billing", nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := sub.Close(); err != nil {
		t.Fatal(err)
	}
}
