package relaykafka

import (
	"errors"
	"fmt"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/relay"
)

// MaxInFlightPerBroker is the most produce requests the sink's producer may have in flight to
// one broker. A Kafka broker remembers the last five batches of each idempotent producer per
// partition: with more in flight, a retried batch can no longer be recognised as a duplicate,
// nor a gap as one. franz-go's idempotent producer keeps to five by itself.
const MaxInFlightPerBroker = 5

// producerProblems reads back the producer settings the sink's client would run with after
// the caller's Opts and reports each one that breaks the relay's guarantees, naming the option
// and the fix. The sink's own settings are right; only Config.Opts can break them:
//
//   - acks other than all: an acknowledged row is deleted from the outbox, and a leader that
//     fails before its followers copied the batch loses it (guarantee 2, no loss);
//   - idempotence disabled: a produce request retried after a lost answer writes its batch
//     twice, and with more than one request in flight a retried batch lands after a later one
//     (guarantee 4, per-key order); franz-go's gapless per-partition failure relies on it too;
//   - more than MaxInFlightPerBroker requests in flight per broker (only settable without
//     idempotence).
//
// The options are applied to clients that are never used (NewClient connects to nothing): one
// with the options alone, for idempotence, and one with idempotence disabled first, so that
// franz-go's own validation (which refuses acks other than all with idempotence, without naming
// the option) does not hide acks and in-flight settings. Options the clients refuse for other
// reasons are left to NewSink's client to report.
func producerProblems(opts []kgo.Opt) []error {
	if len(opts) == 0 {
		return nil
	}
	var problems []error
	seed := kgo.SeedBrokers("127.0.0.1:9") // never dialled
	if plain, err := kgo.NewClient(append([]kgo.Opt{seed}, opts...)...); err == nil {
		disabled, _ := plain.OptValue(kgo.DisableIdempotentWrite).(bool)
		plain.Close()
		if disabled {
			problems = append(problems, errors.New("Opts contains kgo.DisableIdempotentWrite(): the relay needs the idempotent producer (a retried produce request would write its batch twice and could put it after a later batch of the same key); remove the option (on Kafka before 3.0 grant the relay's principal IDEMPOTENT_WRITE on the cluster instead)"))
		}
	}
	probe, err := kgo.NewClient(append([]kgo.Opt{seed, kgo.DisableIdempotentWrite()}, opts...)...)
	if err != nil {
		return problems // the real client reports it
	}
	defer probe.Close()
	if acks, _ := probe.OptValue(kgo.RequiredAcks).(kgo.Acks); acks != kgo.AllISRAcks() {
		problems = append(problems, fmt.Errorf("Opts sets kgo.RequiredAcks(%s): the relay needs acks=all (kgo.AllISRAcks(), the default), or a row deleted from the outbox after the leader's acknowledgement is lost when that leader fails before a follower copied it; remove the option", acksName(acks)))
	}
	if n, _ := probe.OptValue(kgo.MaxProduceRequestsInflightPerBroker).(int); n > MaxInFlightPerBroker {
		problems = append(problems, fmt.Errorf("Opts sets kgo.MaxProduceRequestsInflightPerBroker(%d): at most %d produce requests may be in flight per broker (brokers deduplicate and order only the last %d batches of an idempotent producer); remove the option, the idempotent producer keeps to %d by itself", n, MaxInFlightPerBroker, MaxInFlightPerBroker, MaxInFlightPerBroker))
	}
	return problems
}

// acksName spells acks as the option that sets it.
func acksName(a kgo.Acks) string {
	switch a {
	case kgo.NoAck():
		return "kgo.NoAck(), acks=0"
	case kgo.LeaderAck():
		return "kgo.LeaderAck(), acks=1"
	}
	return "acks other than all"
}

// CheckSaramaProducer reports, as a *relay.ConfigError naming each setting and its fix, the
// settings of a sarama producer config under which NewPublisherSink over a watermill-kafka
// publisher would break the relay's guarantees on a real cluster: Producer.RequiredAcks other
// than sarama.WaitForAll, Producer.Idempotent off, Net.MaxOpenRequests above
// MaxInFlightPerBroker. NewPublisherSink takes a built publisher, whose sarama config cannot
// be read back: call this on the config given to watermill-kafka (PublisherConfig's
// OverwriteSaramaConfig) before building the publisher. Nil means sarama's defaults, which
// fail it (acks from the leader only, no idempotence).
func CheckSaramaProducer(cfg *sarama.Config) error {
	if cfg == nil {
		cfg = sarama.NewConfig()
	}
	var problems []error
	if cfg.Producer.RequiredAcks != sarama.WaitForAll {
		problems = append(problems, fmt.Errorf("sarama Producer.RequiredAcks is %d: set it to sarama.WaitForAll (acks=all), or a row deleted from the outbox after the leader's acknowledgement is lost when that leader fails before a follower copied it", cfg.Producer.RequiredAcks))
	}
	if !cfg.Producer.Idempotent {
		problems = append(problems, errors.New("sarama Producer.Idempotent is false: set it to true (with Net.MaxOpenRequests = 1, as sarama requires), or a retried produce request writes its batch twice or after a later batch of the same key"))
	}
	if cfg.Net.MaxOpenRequests > MaxInFlightPerBroker {
		problems = append(problems, fmt.Errorf("sarama Net.MaxOpenRequests is %d: set it to 1 (an idempotent sarama producer requires it; more than %d in flight break the brokers' ordering of a producer's batches)", cfg.Net.MaxOpenRequests, MaxInFlightPerBroker))
	}
	if len(problems) > 0 {
		return &relay.ConfigError{Scope: "relaykafka (sarama producer)", Problems: problems}
	}
	return nil
}
