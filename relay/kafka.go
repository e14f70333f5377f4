package relay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Kafka sink defaults.
const (
	// DefaultMaxMessageBytes is the largest record the Kafka sink sends: franz-go's and the Java
	// producer's default batch limit, just under the broker's default message.max.bytes.
	DefaultMaxMessageBytes = 1_000_012
	// DefaultDeliveryTimeout bounds how long one batch keeps retrying transient broker errors
	// before the relay backs off and claims again.
	DefaultDeliveryTimeout = 30 * time.Second
)

// KafkaConfig configures NewKafkaSink. Only Brokers is required.
type KafkaConfig struct {
	// Brokers are the seed brokers, host:port.
	Brokers []string
	// ClientID names the client in broker logs and quotas. Default "onceflow-relay".
	ClientID string
	// MaxMessageBytes is the largest record (key, value and headers, encoded) the sink sends;
	// larger rows are refused before sending with a permanent error and parked after the
	// attempt limit, instead of failing alone inside the producer while later messages of the
	// same key go out. It must not exceed the topic's max.message.bytes on the broker.
	// Default DefaultMaxMessageBytes.
	MaxMessageBytes int
	// DeliveryTimeout bounds how long one batch retries transient broker errors (leader
	// changes, timeouts, broker down) inside the producer. At least 1s; default 30s.
	DeliveryTimeout time.Duration
	// DisableAutoTopicCreation stops the client from asking the broker to create missing
	// topics. Default false: the broker's auto.create.topics.enable decides, as with the Java
	// producer and sarama.
	DisableAutoTopicCreation bool
	// Opts are extra franz-go client options appended last, e.g. kgo.DialTLSConfig or
	// kgo.SASL. Options that change producing semantics (idempotence, acks, manual
	// flushing) must not be overridden: the order guarantee depends on them.
	Opts []kgo.Opt
}

// KafkaSink is the relay's fast path: a batch goes to Kafka through franz-go's idempotent
// producer as one flush, usually one produce request per broker, with acks from all in-sync
// replicas and unlimited in-producer retries of transient errors up to DeliveryTimeout.
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
// _watermill_message_uuid header, every metadata entry as a header, the payload as value, and
// the partition key as the Kafka key (no key when empty), so a plain watermill-kafka
// subscriber reads them unchanged.
type KafkaSink struct {
	cl       *kgo.Client
	maxBytes int
}

// NewKafkaSink validates cfg and creates the producer client. It does not contact the
// brokers; use Ping to check them.
func NewKafkaSink(cfg KafkaConfig) (*KafkaSink, error) {
	if cfg.ClientID == "" {
		cfg.ClientID = "onceflow-relay"
	}
	if cfg.MaxMessageBytes == 0 {
		cfg.MaxMessageBytes = DefaultMaxMessageBytes
	}
	if cfg.DeliveryTimeout == 0 {
		cfg.DeliveryTimeout = DefaultDeliveryTimeout
	}
	var problems []error
	if len(cfg.Brokers) == 0 || slices.Contains(cfg.Brokers, "") {
		problems = append(problems, errors.New("no Kafka brokers: set Brokers (--kafka-brokers / KAFKA_BROKERS), e.g. kafka-1:9092,kafka-2:9092"))
	}
	if cfg.MaxMessageBytes < 512 || cfg.MaxMessageBytes > 1<<30 {
		problems = append(problems, fmt.Errorf("MaxMessageBytes is %d; use 512 to %d (0 means the default %d)", cfg.MaxMessageBytes, 1<<30, DefaultMaxMessageBytes))
	}
	if cfg.DeliveryTimeout < time.Second {
		problems = append(problems, fmt.Errorf("DeliveryTimeout is %s; use at least 1s (0 means the default %s)", cfg.DeliveryTimeout, DefaultDeliveryTimeout))
	}
	if len(problems) > 0 {
		return nil, &ConfigError{What: "Kafka config", Problems: problems}
	}
	opts := []kgo.Opt{
		kgo.SeedBrokers(cfg.Brokers...),
		kgo.ClientID(cfg.ClientID),
		// Idempotent writes are franz-go's default; acks=all is what they require.
		kgo.RequiredAcks(kgo.AllISRAcks()),
		// Every record of a batch is buffered before anything is sent, so a failure fails the
		// whole tail of its partition (see KafkaSink) rather than racing with records still
		// being added.
		kgo.ManualFlushing(),
		kgo.MaxBufferedRecords(MaxBatchSize + 1),
		kgo.ProducerBatchMaxBytes(int32(cfg.MaxMessageBytes)),
		kgo.RecordDeliveryTimeout(cfg.DeliveryTimeout),
		// Lets a cancelled batch (shutdown, lost lease) return promptly even with a request in
		// flight. The cost is a possible duplicate with the same event id, which the outbox
		// contract already allows; order is unaffected because the tail of the partition fails
		// with it.
		kgo.AllowIdempotentProduceCancellation(),
	}
	if !cfg.DisableAutoTopicCreation {
		opts = append(opts, kgo.AllowAutoTopicCreation())
	}
	opts = append(opts, cfg.Opts...)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, fmt.Errorf("relay: create Kafka client: %w", err)
	}
	return &KafkaSink{cl: cl, maxBytes: cfg.MaxMessageBytes}, nil
}

// Ping checks that at least one broker answers.
func (s *KafkaSink) Ping(ctx context.Context) error {
	if err := s.cl.Ping(ctx); err != nil {
		return fmt.Errorf("relay: Kafka unreachable: %w", err)
	}
	return nil
}

// Close closes the client; records still buffered fail.
func (s *KafkaSink) Close() error {
	s.cl.Close()
	return nil
}

// Publish implements Sink.
//
// franz-go keeps failures gapless per partition, and a key maps to one partition per topic.
// So the rows of a key go out in one flush only as long as they share a topic: from the first
// row whose topic differs from its key's previous row in the call, the key's rows wait for a
// later round (one more flush), sent only if every earlier row of the key was acknowledged.
// Batches whose keys keep to one topic take a single round.
func (s *KafkaSink) Publish(ctx context.Context, msgs []*Message, errs []error) {
	rounds := [][]int{make([]int, 0, len(msgs))}
	last := make(map[string]string, len(msgs)) // block key → topic of its latest row
	round := make(map[string]int)              // block key → its current round, when > 0
	for i, m := range msgs {
		if t, ok := last[m.blockKey]; ok && t != m.Topic {
			round[m.blockKey]++
			if round[m.blockKey] == len(rounds) {
				rounds = append(rounds, nil)
			}
		}
		last[m.blockKey] = m.Topic
		r := round[m.blockKey]
		rounds[r] = append(rounds[r], i)
	}
	var (
		mu      sync.Mutex
		results = make([]error, len(msgs))
		failed  = map[string]bool{} // block keys with a row not acknowledged
	)
	for _, idx := range rounds {
		s.publishRound(ctx, msgs, idx, errs, results, &mu, failed)
	}
}

// publishRound sends msgs[i] for i in idx as one flush and stores their outcomes in errs.
func (s *KafkaSink) publishRound(ctx context.Context, msgs []*Message, idx []int, errs, results []error, mu *sync.Mutex, failed map[string]bool) {
	var wg sync.WaitGroup
	for _, i := range idx {
		m := msgs[i]
		if failed[m.blockKey] {
			errs[i] = ErrHeldBack
			continue
		}
		if err := ctx.Err(); err != nil {
			// Cancelled (lost lease, shutdown): do not buffer records a later round could only
			// wait for; the rows stay and are sent again.
			failed[m.blockKey] = true
			errs[i] = fmt.Errorf("relay: not sent, the batch was abandoned: %w", err)
			continue
		}
		rec, err := s.record(m)
		if err != nil {
			// Refused before sending: later messages of the key must not go out either.
			failed[m.blockKey] = true
			errs[i] = Permanent(err)
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
				errs[i] = classifyKafka(results[i])
			default:
				if results[i] != nil {
					errs[i] = classifyKafka(results[i])
				} else {
					// Unresolved, or resolved successfully after we stopped waiting: either way
					// the row stays and is sent again; a duplicate carries the same event id.
					errs[i] = fmt.Errorf("relay: no acknowledgement before the batch was abandoned: %w", ctx.Err())
				}
			}
		}
		if errs[i] != nil {
			failed[msgs[i].blockKey] = true
		}
	}
}

// ErrMessageTooLarge is wrapped (as a PermanentError) for rows the Kafka sink refuses to send
// because their encoded record exceeds KafkaConfig.MaxMessageBytes.
var ErrMessageTooLarge = errors.New("message too large for the broker")

// ErrInvalidTopic is wrapped (as a PermanentError) for rows whose topic Kafka cannot accept.
var ErrInvalidTopic = errors.New("invalid Kafka topic name")

// validTopic applies Kafka's rules for topic names: 1 to 249 characters out of ASCII letters,
// digits, '.', '_' and '-', and not "." or "..".
func validTopic(t string) error {
	if t == "" || t == "." || t == ".." || len(t) > 249 {
		return fmt.Errorf("%w %q: use 1 to 249 characters, not \".\" or \"..\"", ErrInvalidTopic, t)
	}
	for _, c := range []byte(t) {
		if !topicChar(c) {
			return fmt.Errorf("%w %q: only ASCII letters, digits, '.', '_' and '-' are allowed", ErrInvalidTopic, t)
		}
	}
	return nil
}

func topicChar(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-'
}

// ErrReservedHeader is wrapped (as a PermanentError) for rows whose metadata uses the header
// name that carries the event id.
var ErrReservedHeader = errors.New("metadata key " + UUIDHeader + " is reserved for the event id")

func (s *KafkaSink) record(m *Message) (*kgo.Record, error) {
	if _, ok := m.Metadata[UUIDHeader]; ok {
		return nil, ErrReservedHeader
	}
	if err := validTopic(m.Topic); err != nil {
		return nil, err
	}
	rec := &kgo.Record{Topic: m.Topic, Value: m.Payload}
	if rec.Value == nil {
		rec.Value = []byte{} // an empty payload, not a null value
	}
	if m.Key != "" {
		rec.Key = []byte(m.Key)
	}
	rec.Headers = make([]kgo.RecordHeader, 0, len(m.Metadata)+1)
	rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: UUIDHeader, Value: []byte(m.EventID)})
	keys := make([]string, 0, len(m.Metadata))
	for k := range m.Metadata {
		keys = append(keys, k)
	}
	slices.Sort(keys) // deterministic header order; consumers read them into a map anyway
	for _, k := range keys {
		rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: k, Value: []byte(m.Metadata[k])})
	}
	if n := encodedSize(rec); n > s.maxBytes {
		return nil, fmt.Errorf("%w: row %d encodes to about %d bytes, over the %d-byte limit; raise the limit (KafkaConfig.MaxMessageBytes, --max-message-bytes) together with the topic's max.message.bytes, or store the data elsewhere and send a reference", ErrMessageTooLarge, m.ID, n, s.maxBytes)
	}
	return rec, nil
}

// encodedSize is an upper bound of the record's size inside a v2 record batch, including the
// batch header, computed like the producer does so oversized rows are caught before sending.
func encodedSize(r *kgo.Record) int {
	n := 1 /* attributes */ + 10 /* timestamp delta, max varlong */ + 5 /* offset delta */
	n += varintLen(len(r.Key)) + len(r.Key)
	n += varintLen(len(r.Value)) + len(r.Value)
	n += varintLen(len(r.Headers))
	for _, h := range r.Headers {
		n += varintLen(len(h.Key)) + len(h.Key) + varintLen(len(h.Value)) + len(h.Value)
	}
	n += varintLen(n)
	return n + 61 /* record batch header */
}

func varintLen(v int) int {
	u := uint64(v<<1) ^ uint64(v>>63) // zigzag
	n := 1
	for u >= 0x80 {
		u >>= 7
		n++
	}
	return n
}

// classifyKafka maps a producer error to the relay's two kinds: permanent (counts toward the
// attempt limit) or transient (retried with backoff forever).
func classifyKafka(err error) error {
	if err == nil {
		return nil
	}
	var ke *kerr.Error
	if errors.As(err, &ke) {
		switch ke {
		case kerr.MessageTooLarge, kerr.RecordListTooLarge, kerr.InvalidRecord, kerr.CorruptMessage,
			kerr.InvalidTopicException, kerr.PolicyViolation, kerr.InvalidTimestamp,
			kerr.UnsupportedForMessageFormat:
			return Permanent(err)
		}
	}
	return err
}
