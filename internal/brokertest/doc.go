// Package brokertest holds onceflow's tests on a Kafka cluster of three brokers (kfake) that
// loses one under load: the relay publishing a steady stream, a batched inbox consumer applying
// effects, a broker gone mid-stream (its connections dropped, its listener closed, the
// partitions it led moved to the others) and back later. It has no code of its own; see
// brokerloss_test.go for what is asserted and measured.
package brokertest
