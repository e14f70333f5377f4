package inboxkafka_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/outbox"
)

// produceRaw sends one record per payload to partition 0 of topic, all with key, in one
// produce call and in order, and returns their message UUIDs.
func produceRaw(t *testing.T, brokers []string, topic, key string, payloads ...[]byte) []string {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.DefaultProduceTopic(topic), kgo.AllowAutoTopicCreation(),
		kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	uuids := make([]string, len(payloads))
	recs := make([]*kgo.Record, len(payloads))
	for i, p := range payloads {
		uuids[i] = outbox.NewUUID()
		if p == nil {
			p = []byte{}
		}
		recs[i] = &kgo.Record{Partition: 0, Key: []byte(key), Value: p, Headers: []kgo.RecordHeader{
			{Key: kafka.UUIDHeaderKey, Value: []byte(uuids[i])},
			{Key: "k", Value: []byte(key)},
		}}
	}
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	return uuids
}

// Issue 33: a batched consumer whose handler decodes JSON with json.NewDecoder gets io.EOF
// for an empty payload. That error is the message's, not the database's: with MaxAttempts 2
// the message is given up (one inbox_poison row) within seconds, and the next message of the
// same key is applied. (io.EOF used to be taken for a lost connection: the batch was retried
// forever, no attempt counted, and the partition never moved.)
func TestBatchConsumerGivesUpAnUndecodablePayload(t *testing.T) {
	t.Parallel()
	f := newBatchFixture(t, 1)
	uuids := produceRaw(t, f.brokers, f.topic, "order-1", nil, []byte(`{"amount": 42}`))
	empty, valid := uuids[0], uuids[1]
	p := f.ib.BatchNoPublish(func(msg *message.Message) error {
		var v struct {
			Amount int `json:"amount"`
		}
		if err := json.NewDecoder(bytes.NewReader(msg.Payload)).Decode(&v); err != nil {
			return err
		}
		return f.effect(msg)
	})
	f.start(kafkatest.Topic("g"), p, func(c *inboxkafka.BatchConfig) {
		c.MaxAttempts = 2
		c.Backoff, c.MaxBackoff = 10*time.Millisecond, 20*time.Millisecond
	})
	poisoned := func() int {
		return f.count(`SELECT count(*) FROM `+f.db.Table("inbox_poison")+` WHERE message_uuid = $1`, empty)
	}
	applied := func() int {
		return f.count(`SELECT count(*) FROM `+f.db.Table("effect")+` WHERE msg_uuid = $1`, valid)
	}
	testutil.AwaitWithin(t, 20*time.Second, "the empty payload given up and the next message of its key applied",
		func() bool { return poisoned() == 1 && applied() == 1 },
		func() string {
			return fmt.Sprintf("%d poison rows of the empty payload, %d effects of the next message "+
				"(json.Decoder's io.EOF was taken for the database's failure: the batch is retried forever, no attempt counted)", poisoned(), applied())
		})
	var attempts int
	var reason string
	if err := f.db.Pool.QueryRow(context.Background(), `SELECT attempts, error FROM `+f.db.Table("inbox_poison")+` WHERE message_uuid = $1`, empty).
		Scan(&attempts, &reason); err != nil {
		t.Fatal(err)
	}
	if attempts != 2 || !strings.Contains(reason, "EOF") {
		t.Errorf("poison row: attempts %d, error %q; want MaxAttempts (2) and the decoder's EOF", attempts, reason)
	}
	if n := f.poisonCount(); n != 1 {
		t.Errorf("%d poison rows, want 1", n)
	}
	if n := f.count(`SELECT count(*) FROM ` + f.db.Table("effect")); n != 1 {
		t.Errorf("%d effects, want 1 (the valid message, once)", n)
	}
}
