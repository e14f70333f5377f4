package relaykafka

import (
	"errors"
	"fmt"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/internal/kafkarecord"
	"github.com/onceflow/onceflow/relay"
)

// UUIDHeader is the Kafka header carrying the event id. It is the header watermill-kafka's
// DefaultMarshaler writes and reads (kafka.UUIDHeaderKey), so a plain watermill-kafka
// subscriber sees the outbox row's event_id as the message UUID.
const UUIDHeader = kafkarecord.UUIDHeader

// ErrMessageTooLarge is wrapped (as a relay.UndeliverableError) for rows the Kafka sink refuses to send
// because their encoded record exceeds Config.MaxMessageBytes.
var ErrMessageTooLarge = errors.New("message too large for the broker")

// ErrInvalidTopic is wrapped (as a relay.UndeliverableError) for rows whose topic Kafka cannot accept.
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

// ErrReservedHeader is wrapped (as a relay.UndeliverableError) for rows whose metadata uses the header
// name that carries the event id.
var ErrReservedHeader = kafkarecord.ErrReservedHeader

// record encodes a row with the codec the batched consumer decodes with (internal/kafkarecord).
func (s *Sink) record(m *relay.Message) (*kgo.Record, error) {
	if _, ok := m.Metadata[UUIDHeader]; ok {
		return nil, ErrReservedHeader
	}
	if err := validTopic(m.Topic); err != nil {
		return nil, err
	}
	rec, err := kafkarecord.Encode(m.Topic, m.Key, m.EventID, m.Metadata, m.Payload)
	if err != nil {
		return nil, err
	}
	if n := encodedSize(rec); n > s.maxBytes {
		return nil, fmt.Errorf("%w: row %d encodes to about %d bytes, over the %d-byte limit; raise the limit (Config.MaxMessageBytes, --max-message-bytes) together with the topic's max.message.bytes, or store the data elsewhere and send a reference", ErrMessageTooLarge, m.ID, n, s.maxBytes)
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

// classify maps a producer error for a record of topic to the relay's kinds: undeliverable
// (counts toward the attempt limit), the topic refused as a whole (undeliverable too, and the
// relay stops sending the topic for a while: relay.TopicError), or transient (retried with
// backoff forever).
func classify(err error, topic string) error {
	if err == nil {
		return nil
	}
	var ke *kerr.Error
	if errors.As(err, &ke) {
		switch ke {
		case kerr.UnknownTopicOrPartition, kerr.TopicAuthorizationFailed:
			// A missing topic (not auto-created) or a missing ACL: every record of the topic is
			// refused until someone creates it or grants access.
			return relay.UnwritableTopic(topic, err)
		case kerr.MessageTooLarge, kerr.RecordListTooLarge, kerr.InvalidRecord, kerr.CorruptMessage,
			kerr.InvalidTopicException, kerr.PolicyViolation, kerr.InvalidTimestamp,
			kerr.UnsupportedForMessageFormat:
			return relay.Undeliverable(err)
		}
	}
	return err
}
