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
	}
	for _, ch := range checks {
		if ch.got != ch.want {
			t.Errorf("%s = %v, want %v", ch.name, ch.got, ch.want)
		}
	}
	if err := c.Validate(); err != nil {
		t.Fatalf("sarama refuses the config: %v", err)
	}
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
