package main

import (
	"context"
	mrand "math/rand/v2"
	"sync"
	"sync/atomic"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// replayer reads every topic of the flow and re-produces a share of the records unchanged
// (same key, value and headers: the same event id and saga metadata), as a broker redelivery
// or a producer retry would. It also keeps the charge commands, for the lost-dedup phase.
type replayer struct {
	cl   *kgo.Client
	rate float64
	done chan struct{}

	seen     atomic.Int64
	mu       sync.Mutex
	replayed map[string]int64       // topic → records re-produced
	records  map[string]int64       // topic → records seen, not counting our copies
	ours     map[string]bool        // event ids we re-produced (their copies come back)
	charges  map[string]*kgo.Record // saga id → its charge command
	on       atomic.Bool
}

func startReplayer(ctx context.Context, brokers, topics []string, chargeTopic string, rate float64) (*replayer, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topics...),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		return nil, err
	}
	r := &replayer{cl: cl, rate: rate, done: make(chan struct{}), replayed: map[string]int64{}, records: map[string]int64{},
		ours: map[string]bool{}, charges: map[string]*kgo.Record{}}
	r.on.Store(true)
	go func() {
		defer close(r.done)
		for {
			fs := cl.PollFetches(ctx)
			if ctx.Err() != nil || fs.IsClientClosed() {
				return
			}
			fs.EachRecord(func(rec *kgo.Record) {
				id := header(rec, relaykafka.UUIDHeader)
				r.mu.Lock()
				ours := r.ours[id]
				if !ours {
					r.records[rec.Topic]++
				}
				if rec.Topic == chargeTopic {
					r.charges[header(rec, outbox.MetadataSagaID)] = rec
				}
				r.mu.Unlock()
				if ours {
					return // our own copy coming back
				}
				r.seen.Add(1)
				if !r.on.Load() || mrand.Float64() >= r.rate {
					return
				}
				r.produce(ctx, rec, true)
			})
		}
	}()
	return r, nil
}

// produce re-produces rec unchanged; counted says whether it counts as an injected duplicate.
func (r *replayer) produce(ctx context.Context, rec *kgo.Record, counted bool) bool {
	r.mu.Lock()
	r.ours[header(rec, relaykafka.UUIDHeader)] = true
	r.mu.Unlock()
	dup := &kgo.Record{Topic: rec.Topic, Key: rec.Key, Value: rec.Value, Headers: rec.Headers}
	if err := r.cl.ProduceSync(ctx, dup).FirstErr(); err != nil {
		return false
	}
	if counted {
		r.mu.Lock()
		r.replayed[rec.Topic]++
		r.mu.Unlock()
	}
	return true
}

// injected returns how many duplicates were injected into topic.
func (r *replayer) injected(topic string) int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.replayed[topic]
}

// received returns how many records were published to topic, not counting the replayer's
// own copies.
func (r *replayer) received(topic string) int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.records[topic]
}

func (r *replayer) total() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	var n int64
	for _, v := range r.replayed {
		n += v
	}
	return n
}

// charge returns the charge command of a saga, if it was seen.
func (r *replayer) charge(sagaID string) *kgo.Record {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.charges[sagaID]
}

func (r *replayer) close() {
	r.cl.Close()
	<-r.done
}

func header(rec *kgo.Record, key string) string {
	for _, h := range rec.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}
