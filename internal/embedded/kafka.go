package embedded

import (
	"fmt"

	"github.com/twmb/franz-go/pkg/kfake"
)

// Kafka is an in-process Kafka cluster (franz-go's kfake) speaking the real wire protocol,
// so sarama's idempotent producer and consumer groups work against it unchanged.
type Kafka struct {
	// Cluster is the kfake cluster, exposed so tests can inject faults with ControlKey.
	Cluster *kfake.Cluster
}

// StartKafka starts an in-process cluster with one broker that creates topics on first use
// with the given number of partitions (default 1). Extra kfake options are appended.
func StartKafka(partitions int32, opts ...kfake.Opt) (*Kafka, error) {
	if partitions <= 0 {
		partitions = 1
	}
	all := append([]kfake.Opt{
		kfake.NumBrokers(1),
		kfake.AllowAutoTopicCreation(),
		kfake.DefaultNumPartitions(int(partitions)),
	}, opts...)
	c, err := kfake.NewCluster(all...)
	if err != nil {
		return nil, fmt.Errorf("embedded kafka: start kfake: %w", err)
	}
	return &Kafka{Cluster: c}, nil
}

// Brokers is the list of host:port addresses to give a client.
func (k *Kafka) Brokers() []string { return k.Cluster.ListenAddrs() }

// Stop closes the cluster.
func (k *Kafka) Stop() { k.Cluster.Close() }
