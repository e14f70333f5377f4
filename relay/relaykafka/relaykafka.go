// Package relaykafka is the relay's Kafka sink: a batch goes to Kafka through franz-go's
// idempotent producer (acks from all in-sync replicas, gapless per-partition failures), so a
// key's order survives broker errors. It lives apart from package relay so that the relay core
// links no Kafka client.
//
//	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: []string{"kafka-1:9092"}})
//	r, err := relay.New(relay.Config{Pool: pool, Sink: sink})
//	err = r.Run(ctx)
//
// Records are what watermill-kafka's DefaultMarshaler produces, so a plain watermill-kafka
// subscriber (inbox/inboxkafka) reads them unchanged.
//
// For deployments that must produce through a watermill-kafka (sarama) publisher instead,
// NewPublisherSink wraps relay.NewPublisherSink with SaramaUndeliverable, which recognises
// the sarama errors that retrying cannot fix.
package relaykafka

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/relay"
)

// Sink defaults.
const (
	// DefaultMaxMessageBytes is the largest record the sink sends: franz-go's and the Java
	// producer's default batch limit, just under the broker's default message.max.bytes.
	DefaultMaxMessageBytes = 1_000_012
	// DefaultDeliveryTimeout bounds how long one batch keeps retrying transient broker errors
	// before the relay backs off and claims again.
	DefaultDeliveryTimeout = 30 * time.Second

	// MetadataMinAge is the shortest time between two metadata refreshes of the sink's client.
	// After NOT_LEADER_FOR_PARTITION (a leader moved: broker restarts, rolling upgrades,
	// partition reassignment) the producer cannot send that partition until it learned the new
	// leader; franz-go's default of 5 s then stalls every batch for seconds at each move, and
	// under repeated moves a drain slowed down ~180× in TestDrainUnderLeaderChurn. Each
	// NOT_LEADER then holds the relay's batch until the refresh: measured in make bench's
	// drain_churn (docs/relay.md), 100 ms cost a drain ~70 ms per refused request, 50 ms ~30 ms.
	// 50 ms costs at most 20 metadata requests a second while leaders move, none otherwise.
	MetadataMinAge = 50 * time.Millisecond
	// RetryBackoffMin and RetryBackoffMax bound the client's backoff between retries of a
	// failed produce request (doubling, ±20 % jitter); franz-go's defaults are 250 ms and 5 s.
	// A retry rarely needs to wait longer than the metadata refresh it follows.
	RetryBackoffMin = 20 * time.Millisecond
	RetryBackoffMax = time.Second
)

// retryBackoff doubles from RetryBackoffMin to RetryBackoffMax with ±20 % jitter.
func retryBackoff(fails int) time.Duration {
	d := RetryBackoffMax
	if fails < 1 {
		fails = 1
	}
	if fails <= 10 {
		d = min(RetryBackoffMin<<(fails-1), RetryBackoffMax)
	}
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
}

// Config configures NewSink. Only Brokers is required.
type Config struct {
	// Brokers are the seed brokers, host:port.
	Brokers []string
	// ClientID names the client in broker logs, quotas and ACL audit logs. Default
	// DefaultClientID ("onceflow-relay").
	ClientID string
	// TLS connects to the brokers over TLS (CA, client certificate, server name). Default:
	// plaintext.
	TLS TLSConfig
	// SASL authenticates to the brokers (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512). Default: none.
	SASL SASLConfig
	// Compression is the codec of record batches: "none", "gzip", "snappy", "lz4" or "zstd".
	// A batch goes out compressed only when that makes it smaller. Every consumer of the
	// topics must decode the codec (watermill-kafka's sarama does all five). Default
	// DefaultCompression ("snappy").
	Compression string
	// MaxMessageBytes is the largest record (key, value and headers, encoded) the sink sends;
	// larger rows are refused before sending with an undeliverable error (ErrMessageTooLarge)
	// and parked after the attempt limit, instead of failing alone inside the producer while
	// later messages of the same key go out. It must not exceed the topic's max.message.bytes
	// on the broker. Default DefaultMaxMessageBytes.
	MaxMessageBytes int
	// DeliveryTimeout bounds how long one batch retries transient broker errors (leader
	// changes, timeouts, broker down) inside the producer. At least 1s; default 30s.
	DeliveryTimeout time.Duration
	// DisableAutoTopicCreation stops the client from asking the broker to create missing
	// topics. Default false: the broker's auto.create.topics.enable decides, as with the Java
	// producer and sarama.
	DisableAutoTopicCreation bool
	// Logger receives the warnings of the durability check the sink runs once per topic,
	// after its first acknowledged write (see CheckDurability): a replication factor below 3,
	// min.insync.replicas below 2, unclean leader election. Default slog.Default().
	Logger *slog.Logger
	// Opts are extra franz-go client options appended last, e.g. a SASL mechanism the fields
	// above do not offer (kgo.SASL with OAUTHBEARER or AWS_MSK_IAM) or kgo.Dialer. Options
	// that change producing semantics (idempotence, acks, manual flushing) must not be
	// overridden: the order guarantee depends on them. NewSink refuses Opts that set acks
	// other than all (kgo.RequiredAcks), disable idempotence (kgo.DisableIdempotentWrite) or
	// allow more than MaxInFlightPerBroker requests in flight per broker
	// (kgo.MaxProduceRequestsInflightPerBroker), naming the option.
	Opts []kgo.Opt
}

// Sink is the relay's fast path (a relay.Sink): a batch goes to Kafka through franz-go's
// idempotent producer as one flush, usually one produce request per broker, with acks from all
// in-sync replicas and unlimited in-producer retries of transient errors up to
// DeliveryTimeout.
//
// Why franz-go rather than sarama: when a produce request fails with a non-retriable error,
// franz-go fails that batch and every later record buffered for the same partition, so a
// message is never acknowledged after an earlier message of the same key and topic failed
// (Publish sends a key's rows for a second topic in a later flush). sarama's
// idempotent producer fails the broken batch alone, bumps its epoch and then sends the
// partition's next batch, which reorders a key (e.g. a 100-message SendMessages with the first
// produce request rejected publishes messages 1..99 and fails message 0).
//
// Records are what watermill-kafka's DefaultMarshaler produces: the event id in the
// UUIDHeader header, every metadata entry as a header, the payload as value, and the partition
// key as the Kafka key (no key when empty), so a plain watermill-kafka subscriber reads them
// unchanged.
type Sink struct {
	cl       *kgo.Client
	maxBytes int
	conn     Config // how the client connects, without the password: for Ping's errors
	logger   *slog.Logger
	// adminOpts reach the cluster without asking it to create topics: for CheckDurability,
	// which must not create a topic by looking at it.
	adminOpts []kgo.Opt

	// Durability checks of the topics written (checkNewTopics).
	checked  sync.Map // topic → true once a check started
	bg       sync.WaitGroup
	bgCtx    context.Context //nolint:containedctx // cancelled by Close, for the background checks
	bgCancel context.CancelFunc
}

var _ relay.Sink = (*Sink)(nil)

// NewSink validates cfg, reporting every problem at once as a *relay.ConfigError, and creates
// the producer client. It does not contact the brokers; use Ping to check them.
func NewSink(cfg Config) (*Sink, error) {
	if cfg.MaxMessageBytes == 0 {
		cfg.MaxMessageBytes = DefaultMaxMessageBytes
	}
	if cfg.DeliveryTimeout == 0 {
		cfg.DeliveryTimeout = DefaultDeliveryTimeout
	}
	opts, problems := cfg.connection() // brokers, client id, TLS, SASL
	adminOpts := append(slices.Clone(opts), cfg.Opts...)
	codecs, err := compressionCodec(cfg.Compression)
	if err != nil {
		problems = append(problems, err)
	}
	if cfg.MaxMessageBytes < 512 || cfg.MaxMessageBytes > 1<<30 {
		problems = append(problems, fmt.Errorf("MaxMessageBytes is %d; use 512 to %d (0 means the default %d)", cfg.MaxMessageBytes, 1<<30, DefaultMaxMessageBytes))
	}
	if cfg.DeliveryTimeout < time.Second {
		problems = append(problems, fmt.Errorf("DeliveryTimeout is %s; use at least 1s (0 means the default %s)", cfg.DeliveryTimeout, DefaultDeliveryTimeout))
	}
	// acks=all, idempotence, at most 5 requests in flight: required on a real cluster.
	problems = append(problems, producerProblems(cfg.Opts)...)
	if len(problems) > 0 {
		return nil, &relay.ConfigError{Scope: "relaykafka", Problems: problems}
	}
	opts = append(opts,
		kgo.ProducerBatchCompression(codecs...),
		// Idempotent writes are franz-go's default; acks=all is what they require.
		kgo.RequiredAcks(kgo.AllISRAcks()),
		// Every record of a batch is buffered before anything is sent, so a failure fails the
		// whole tail of its partition (see Sink) rather than racing with records still being
		// added.
		kgo.ManualFlushing(),
		kgo.MaxBufferedRecords(relay.MaxBatchSize+1),
		kgo.ProducerBatchMaxBytes(int32(cfg.MaxMessageBytes)),
		kgo.RecordDeliveryTimeout(cfg.DeliveryTimeout),
		// Lets a cancelled batch (shutdown, lost lease) return promptly even with a request in
		// flight. The cost is a possible duplicate with the same event id, which the outbox
		// contract already allows; order is unaffected because the tail of the partition fails
		// with it.
		kgo.AllowIdempotentProduceCancellation(),
		kgo.MetadataMinAge(MetadataMinAge),
		kgo.RetryBackoffFn(retryBackoff),
	)
	if !cfg.DisableAutoTopicCreation {
		opts = append(opts, kgo.AllowAutoTopicCreation())
	}
	opts = append(opts, cfg.Opts...)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, fmt.Errorf("relaykafka: create Kafka client: %w", err)
	}
	cfg.SASL.Password = ""
	s := &Sink{cl: cl, maxBytes: cfg.MaxMessageBytes, conn: cfg, logger: cfg.Logger, adminOpts: adminOpts}
	if s.logger == nil {
		s.logger = slog.Default()
	}
	s.bgCtx, s.bgCancel = context.WithCancel(context.Background())
	return s, nil
}

// Ping checks that at least one broker answers, TLS handshake and SASL authentication
// included. Its error wraps a *ConnectionError that says which settings to check.
func (s *Sink) Ping(ctx context.Context) error {
	if err := s.cl.Ping(ctx); err != nil {
		return fmt.Errorf("relaykafka: %w", s.conn.Explain(err))
	}
	return nil
}

// Close closes the client; records still buffered fail.
func (s *Sink) Close() error {
	s.bgCancel()
	s.bg.Wait()
	s.cl.Close()
	return nil
}

// chain identifies a message's order chain: its partition key, or its own outbox id when it
// has none (rows without a key have no order to keep). It is what the relay core calls a
// block key, computed here from the exported fields.
type chain struct {
	key string
	id  int64
}

func chainOf(m *relay.Message) chain {
	if m.Key != "" {
		return chain{key: m.Key}
	}
	return chain{id: m.ID}
}

// Publish implements relay.Sink.
//
// franz-go keeps failures gapless per partition, and a key maps to one partition per topic.
// So the rows of a key go out in one flush only as long as they share a topic: from the first
// row whose topic differs from its key's previous row in the call, the key's rows wait for a
// later round (one more flush), sent only if every earlier row of the key was acknowledged.
// Batches whose keys keep to one topic take a single round.
func (s *Sink) Publish(ctx context.Context, msgs []*relay.Message, errs []error) {
	rounds := [][]int{make([]int, 0, len(msgs))}
	last := make(map[chain]string, len(msgs)) // chain → topic of its latest row
	round := make(map[chain]int)              // chain → its current round, when > 0
	for i, m := range msgs {
		c := chainOf(m)
		if t, ok := last[c]; ok && t != m.Topic {
			round[c]++
			if round[c] == len(rounds) {
				rounds = append(rounds, nil)
			}
		}
		last[c] = m.Topic
		r := round[c]
		rounds[r] = append(rounds[r], i)
	}
	var (
		mu      sync.Mutex
		results = make([]error, len(msgs))
		failed  = map[chain]bool{} // chains with a row not acknowledged
	)
	for _, idx := range rounds {
		s.publishRound(ctx, msgs, idx, errs, results, &mu, failed)
	}
	var acked map[string]bool // topics written for the first time: check their durability
	for i, m := range msgs {
		if errs[i] != nil || acked[m.Topic] {
			continue
		}
		if _, done := s.checked.Load(m.Topic); !done {
			if acked == nil {
				acked = map[string]bool{}
			}
			acked[m.Topic] = true
		}
	}
	if acked != nil {
		s.checkNewTopics(acked)
	}
}

// publishRound sends msgs[i] for i in idx as one flush and stores their outcomes in errs.
func (s *Sink) publishRound(ctx context.Context, msgs []*relay.Message, idx []int, errs, results []error, mu *sync.Mutex, failed map[chain]bool) {
	var wg sync.WaitGroup
	for _, i := range idx {
		m := msgs[i]
		c := chainOf(m)
		if failed[c] {
			errs[i] = relay.ErrHeldBack
			continue
		}
		if err := ctx.Err(); err != nil {
			// Cancelled (lost lease, shutdown): do not buffer records a later round could only
			// wait for; the rows stay and are sent again.
			failed[c] = true
			errs[i] = fmt.Errorf("relaykafka: not sent, the batch was abandoned: %w", err)
			continue
		}
		rec, err := s.record(m)
		if err != nil {
			// Refused before sending: later messages of the key must not go out either.
			failed[c] = true
			errs[i] = relay.Undeliverable(err)
			continue
		}
		wg.Add(1)
		s.cl.Produce(ctx, rec, func(_ *kgo.Record, err error) {
			mu.Lock()
			results[i] = err
			mu.Unlock()
			wg.Done()
		})
	}
	_ = s.cl.Flush(ctx) // outcomes arrive through the promises

	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		// Cancelled records fail promptly (AllowIdempotentProduceCancellation); give the client
		// a moment, then report whatever is still unresolved as not acknowledged.
		select {
		case <-done:
		case <-time.After(5 * time.Second):
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for _, i := range idx {
		if errs[i] == nil {
			select {
			case <-done:
				errs[i] = classify(results[i], msgs[i].Topic)
			default:
				if results[i] != nil {
					errs[i] = classify(results[i], msgs[i].Topic)
				} else {
					// Unresolved, or resolved successfully after we stopped waiting: either way
					// the row stays and is sent again; a duplicate carries the same event id.
					errs[i] = fmt.Errorf("relaykafka: no acknowledgement before the batch was abandoned: %w", ctx.Err())
				}
			}
		}
		if errs[i] != nil {
			failed[chainOf(msgs[i])] = true
		}
	}
}
