package onceflowtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// startKafka returns the cluster in KAFKA_BROKERS with the topics created, or an in-process
// kfake cluster seeded with them.
func startKafka(ctx context.Context, opts KafkaOptions) (*Kafka, error) {
	if err := opts.check(); err != nil {
		return nil, err
	}
	if opts.Partitions == 0 {
		opts.Partitions = 1
	}
	if env := os.Getenv("KAFKA_BROKERS"); env != "" {
		brokers := strings.Split(env, ",")
		if err := createTopics(ctx, brokers, opts); err != nil {
			return nil, err
		}
		return &Kafka{Brokers: brokers}, nil
	}
	kopts := []kfake.Opt{kfake.NumBrokers(1), kfake.DefaultNumPartitions(int(opts.Partitions))}
	if len(opts.Topics) > 0 {
		kopts = append(kopts, kfake.SeedTopics(opts.Partitions, opts.Topics...))
	}
	if opts.AutoCreateTopics {
		kopts = append(kopts, kfake.AllowAutoTopicCreation())
	}
	c, err := kfake.NewCluster(kopts...)
	if err != nil {
		return nil, fmt.Errorf("start the in-process Kafka (kfake): %w", err)
	}
	return &Kafka{Brokers: c.ListenAddrs(), Cluster: c}, nil
}

// check reports every problem with opts.
func (opts KafkaOptions) check() error {
	var errs []error
	if opts.Partitions < 0 {
		errs = append(errs, fmt.Errorf("KafkaOptions.Partitions is %d; use 0 for the default (1) or a positive count", opts.Partitions))
	}
	for i, topic := range opts.Topics {
		if topic == "" {
			errs = append(errs, fmt.Errorf("KafkaOptions.Topics[%d] is empty; name the topic", i))
		}
	}
	return errors.Join(errs...)
}

// close closes the in-process cluster; a real one is left alone.
func (k *Kafka) close() {
	if k.Cluster != nil {
		k.Cluster.Close()
	}
}

// createTopics creates the topics that do not exist yet on a real cluster, with the broker's
// default replication factor.
func createTopics(ctx context.Context, brokers []string, opts KafkaOptions) error {
	if len(opts.Topics) == 0 {
		return nil
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		return fmt.Errorf("connect to KAFKA_BROKERS: %w", err)
	}
	defer cl.Close()
	req := kmsg.NewPtrCreateTopicsRequest()
	req.TimeoutMillis = 30_000
	for _, name := range opts.Topics {
		t := kmsg.NewCreateTopicsRequestTopic()
		t.Topic = name
		t.NumPartitions = opts.Partitions
		t.ReplicationFactor = -1 // the broker's default.replication.factor
		req.Topics = append(req.Topics, t)
	}
	res, err := req.RequestWith(ctx, cl)
	if err != nil {
		return fmt.Errorf("create topics on KAFKA_BROKERS: %w", err)
	}
	var errs []error
	for _, t := range res.Topics {
		if err := kerr.ErrorForCode(t.ErrorCode); err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
			errs = append(errs, fmt.Errorf("create topic %s on KAFKA_BROKERS: %w", t.Topic, err))
		}
	}
	return errors.Join(errs...)
}
