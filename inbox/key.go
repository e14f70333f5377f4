package inbox

import (
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/internal/engine"
	"github.com/onceflow/onceflow/outbox"
)

// MaxKeyBytes bounds a dedup key. The key is part of processed_event's primary key, and a
// B-tree entry must fit in a third of a page; a longer key is refused rather than truncated,
// because truncation could make two different messages look like duplicates.
const MaxKeyBytes = engine.MaxKeyBytes

// ErrNoKey is wrapped by the error returned for a message that has no usable dedup key (no
// UUID, incomplete saga metadata, or a KeyFunc error). Such a message is never processed
// without deduplication; Config.NoKeyPolicy decides whether it is returned as an error (the
// default, so a poison-queue middleware can take it) or acknowledged and dropped.
// Retrying it cannot help: exclude it in middleware.Retry's ShouldRetry with errors.Is.
var ErrNoKey = engine.ErrNoKey

// KeyFunc returns the dedup key of a message. Two deliveries with the same key (for the same
// consumer) are one message: the handler runs for the first and the others are skipped.
// Return an error wrapping ErrNoKey (or any error) when the message carries no usable key.
type KeyFunc func(msg *message.Message) (string, error)

// DefaultKey is the default KeyFunc:
//
//   - a saga message (metadata outbox.MetadataSagaID set) is keyed by saga id, step, phase and
//     attempt (SagaKey), so the same step delivered twice runs once even if it was re-sent
//     with a new event id, while a deliberate re-send (the next attempt) and the
//     compensation of a step are different keys;
//   - any other message is keyed by its Watermill UUID, the event id the outbox assigned once.
//
// A saga message with incomplete or malformed saga metadata, or a message without a UUID, has
// no usable key and yields an error wrapping ErrNoKey.
func DefaultKey(msg *message.Message) (string, error) {
	ref, isSaga, err := outbox.SagaOf(msg)
	if err != nil {
		return "", fmt.Errorf("%w: saga message: %w", ErrNoKey, err)
	}
	if isSaga {
		return SagaKey(ref)
	}
	return EventKey(msg.UUID)
}

// EventKey is the dedup key of a plain event: "event:" followed by its id.
func EventKey(eventID string) (string, error) {
	if eventID == "" {
		return "", fmt.Errorf("%w: the message UUID is empty (publish through the outbox, or set the %q header, or configure a KeyFunc)", ErrNoKey, "_watermill_message_uuid")
	}
	return checkKey("event:" + eventID)
}

// SagaKey is the dedup key of a saga message: "saga:" followed by the quoted saga id and step,
// the phase and the attempt, e.g. saga:"0193…":"reserve-stock":action:1. Quoting makes the
// key unambiguous whatever characters the id and step contain. A zero Phase means
// outbox.SagaPhaseAction and a zero Attempt means 1, as on the wire.
func SagaKey(ref outbox.SagaRef) (string, error) {
	if err := ref.Validate(); err != nil {
		return "", fmt.Errorf("%w: saga message: %w", ErrNoKey, err)
	}
	if ref.Phase == "" {
		ref.Phase = outbox.SagaPhaseAction
	}
	if ref.Attempt == 0 {
		ref.Attempt = 1
	}
	return checkKey("saga:" + strconv.Quote(ref.ID) + ":" + strconv.Quote(ref.Step) + ":" + string(ref.Phase) + ":" + strconv.Itoa(ref.Attempt))
}

// checkKey refuses keys PostgreSQL cannot store or index: empty, NUL bytes, invalid UTF-8,
// too long.
func checkKey(key string) (string, error) { return engine.CheckKey(key) }

// NoKeyPolicy says what the middleware does with a message that has no usable dedup key.
// Either way the handler does not run: processing a message without deduplication would
// silently give up the exactly-once effect.
type NoKeyPolicy int

const (
	// RejectNoKey returns an error wrapping ErrNoKey, so the message is nacked, or taken by a
	// poison-queue middleware placed outside the inbox. The default.
	RejectNoKey NoKeyPolicy = iota
	// DropNoKey logs a warning, counts the message (Metrics.NoKey) and acknowledges it.
	DropNoKey
)

// String returns the policy's name, as used in configuration errors.
func (p NoKeyPolicy) String() string {
	switch p {
	case RejectNoKey:
		return "RejectNoKey"
	case DropNoKey:
		return "DropNoKey"
	}
	return "NoKeyPolicy(" + strconv.Itoa(int(p)) + ")"
}
