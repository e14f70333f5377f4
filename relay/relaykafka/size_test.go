package relaykafka

import (
	"context"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

// TestEncodedSizeIsAnUpperBound: a record whose estimated size is exactly the producer's batch
// limit is accepted by franz-go, so the pre-check never refuses what the producer would send;
// one byte less of limit than the real need is refused by the producer, so the estimate is
// tight enough to be useful.
func TestEncodedSizeIsAnUpperBound(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.AllowAutoTopicCreation(), kfake.BrokerConfigs(map[string]string{"message.max.bytes": "10000000"}))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 30 {
		rec := &kgo.Record{Topic: "size", Key: []byte(strings.Repeat("k", rng.IntN(300))), Value: make([]byte, 500+rng.IntN(200_000))}
		for range rng.IntN(6) {
			rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: strings.Repeat("h", 1+rng.IntN(40)), Value: []byte(strings.Repeat("v", rng.IntN(300)))})
		}
		est := encodedSize(rec)
		if err := produceWithLimit(t, c, rec, est); err != nil {
			t.Fatalf("record %d: estimate %d, but the producer refused it at that limit: %v", i, est, err)
		}
		// The real size is at most 15 bytes (the worst-case varints we assume) below the
		// estimate: with a limit 16 bytes lower, the producer must refuse.
		if err := produceWithLimit(t, c, rec, est-16); err == nil {
			t.Fatalf("record %d: accepted with a limit 16 bytes below the estimate %d: the estimate is loose", i, est)
		}
	}
}

func produceWithLimit(t *testing.T, c *kfake.Cluster, rec *kgo.Record, limit int) error {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(c.ListenAddrs()...), kgo.AllowAutoTopicCreation(), kgo.ProducerBatchMaxBytes(int32(limit)),
		kgo.ProducerBatchCompression(kgo.NoCompression()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r := *rec
	return cl.ProduceSync(ctx, &r).FirstErr()
}
