package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
)

// Sizes of drain_churn.
const (
	churnRows     = 50_000
	churnShuffle  = 300 * time.Millisecond // leaders of every partition move this often
	churnNotLeade = 0.10                   // share of produce requests answered NOT_LEADER_FOR_PARTITION
)

// benchDrainChurn: a relay with the production settings (relay and relaykafka defaults) drains
// 50,000 rows from a 3-broker kfake with 6 partitions, once calm and once while every
// partition's leader moves every 300 ms and a tenth of the produce requests are answered
// NOT_LEADER_FOR_PARTITION. Each drain is timed from the relay's start to an empty outbox
// (every row acknowledged by the broker). The figure is the ratio.
func benchDrainChurn(ctx context.Context, e *env) ([]result, error) {
	cluster, err := kfake.NewCluster(kfake.NumBrokers(3), kfake.AllowAutoTopicCreation(), kfake.DefaultNumPartitions(6))
	if err != nil {
		return nil, err
	}
	defer cluster.Close()
	brokers := cluster.ListenAddrs()
	drain := func(name string) (time.Duration, error) {
		pool, schema, err := e.freshSchema(ctx, "churn")
		if err != nil {
			return 0, err
		}
		defer pool.Close()
		if err := fillOutbox(ctx, pool, schema, benchTopic(name), keysWhere(60, func(int) bool { return true }), churnRows, benchPayloadSQL); err != nil {
			return 0, err
		}
		sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: brokers})
		if err != nil {
			return 0, err
		}
		defer func() { _ = sink.Close() }()
		r, err := relay.New(relay.Config{Pool: pool, Sink: sink, Schema: schema, Logger: e.relayLog()})
		if err != nil {
			return 0, err
		}
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		start := time.Now()
		go func() { done <- r.Run(rctx) }()
		defer func() {
			cancel()
			if err := <-done; err != nil {
				e.log.Error("relay", "err", err)
			}
		}()
		for {
			var n int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+pgsql.Table(schema, "outbox")).Scan(&n); err != nil {
				return 0, err
			}
			if n == 0 {
				return time.Since(start), nil
			}
			if time.Since(start) > 5*time.Minute {
				return 0, fmt.Errorf("%s: %d rows still pending after 5 minutes", name, n)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	calm, err := drain("churn-calm")
	if err != nil {
		return nil, err
	}
	var mu sync.Mutex
	rng := rand.New(rand.NewPCG(1, 2))
	var requests, injected atomic.Int64
	cluster.ControlKey(int16(kmsg.Produce), func(r kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		requests.Add(1)
		mu.Lock()
		hit := rng.Float64() < churnNotLeade
		mu.Unlock()
		if !hit {
			return nil, nil, false
		}
		injected.Add(1)
		req := r.(*kmsg.ProduceRequest)
		resp := req.ResponseKind().(*kmsg.ProduceResponse)
		for _, rt := range req.Topics {
			st := kmsg.NewProduceResponseTopic()
			st.Topic = rt.Topic
			for _, rp := range rt.Partitions {
				sp := kmsg.NewProduceResponseTopicPartition()
				sp.Partition = rp.Partition
				sp.ErrorCode = kerr.NotLeaderForPartition.Code
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	})
	sctx, stopShuffle := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var moves atomic.Int64
	wg.Go(func() {
		t := time.NewTicker(churnShuffle)
		defer t.Stop()
		for {
			select {
			case <-sctx.Done():
				return
			case <-t.C:
				cluster.ShufflePartitionLeaders()
				moves.Add(1)
			}
		}
	})
	churn, err := drain("churn-faults")
	stopShuffle()
	wg.Wait()
	if err != nil {
		return nil, err
	}
	ratio := churn.Seconds() / calm.Seconds()
	fmt.Fprintf(os.Stderr, "  drain_churn calm %s, under churn %s (%.2f×): %d leader shuffles, %d of %d produce requests NOT_LEADER\n",
		calm.Round(time.Millisecond), churn.Round(time.Millisecond), ratio, moves.Load(), injected.Load(), requests.Load())
	return []result{
		{Scenario: "drain_churn", System: "calm", Value: churnRows / calm.Seconds(), Unit: "ev/s", HigherIsBetter: true},
		{Scenario: "drain_churn", System: "leader-churn", Value: churnRows / churn.Seconds(), Unit: "ev/s", HigherIsBetter: true,
			Versus: fmt.Sprintf("%.2f× slower", ratio), Target: "≤ 3× slower"},
	}, nil
}
