package outbox

import (
	"errors"
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Metadata keys onceflow reads and writes: the wire contract between writers, the relay and
// consumers. They travel as Kafka headers like any other metadata (except MetadataTopic, which
// is consumed by the write), so a plain watermill-kafka subscriber sees them too. Renaming one
// is a breaking change of the wire format: messages already in outboxes and topics keep the
// old name.
const (
	// MetadataPartitionKey holds the partition key. The writer stores it in its own column and
	// the relay sends it as the Kafka message key; messages with the same key keep their order.
	MetadataPartitionKey = "partition_key"
	// MetadataTopic addresses one message of a write call to a topic of its own (ToTopic). The
	// writer removes it; it is never stored or published.
	MetadataTopic = "onceflow_topic"
	// MetadataTraceParent and MetadataTraceState carry W3C trace context across the broker,
	// verbatim (https://www.w3.org/TR/trace-context/).
	MetadataTraceParent = "traceparent"
	MetadataTraceState  = "tracestate"

	// MetadataSagaID, MetadataSagaStep, MetadataSagaPhase and MetadataSagaAttempt identify a saga
	// message (a command to a participant, or its reply). When MetadataSagaID is present the
	// inbox deduplicates on the four of them (see SagaRef) instead of the event id, so a step
	// re-sent with a new event id still runs once per attempt.
	//
	//   saga_id       the saga's id (a UUIDv7, or the caller's idempotent id); non-empty
	//   saga_step     the step's name in the saga definition; non-empty
	//   saga_phase    SagaPhaseAction or SagaPhaseCompensation; absent means action
	//   saga_attempt  the attempt number, a decimal integer >= 1; absent means 1
	MetadataSagaID      = "saga_id"
	MetadataSagaStep    = "saga_step"
	MetadataSagaPhase   = "saga_phase"
	MetadataSagaAttempt = "saga_attempt"

	// MetadataSagaName, MetadataSagaReplyTo, MetadataSagaOutcome and MetadataSagaReason are
	// the rest of package saga's contract between an orchestrator and its participants:
	//
	//   saga_name      the saga definition's name (commands and replies)
	//   saga_reply_to  the topic a participant sends its reply to (commands)
	//   saga_outcome   SagaOutcomeDone, SagaOutcomeFailed, SagaOutcomeRetry or
	//                  SagaOutcomeRefused (replies)
	//   saga_reason    why a step failed or asks to be retried, for operators (replies)
	//   saga_took_effect  "true" on a command of a step whose action the orchestrator knows
	//                  took effect (a participant answered it done): a participant that finds
	//                  no barrier record of that action must not decide that it never ran
	//                  (commands)
	//   saga_retry_after  on a retry reply, the wait the participant asked for with
	//                  inbox.RetryAfter, as a Go duration ("10m0s"): the orchestrator re-sends
	//                  no sooner (replies)
	MetadataSagaName       = "saga_name"
	MetadataSagaReplyTo    = "saga_reply_to"
	MetadataSagaOutcome    = "saga_outcome"
	MetadataSagaReason     = "saga_reason"
	MetadataSagaTookEffect = "saga_took_effect"
	MetadataSagaRetryAfter = "saga_retry_after"
)

// The values of MetadataSagaOutcome.
const (
	// SagaOutcomeDone: the step's action (or compensation) took effect; the reply's payload
	// is the participant's result.
	SagaOutcomeDone = "done"
	// SagaOutcomeFailed: a business failure; the action took no effect and the saga compensates.
	SagaOutcomeFailed = "failed"
	// SagaOutcomeRetry: a transient failure; nothing took effect and the orchestrator re-sends
	// the command (a new attempt) after a backoff, within the step's attempt budget.
	SagaOutcomeRetry = "retry"
	// SagaOutcomeRefused: the participant cannot decide the command safely (the barrier
	// record of an action the orchestrator knows took effect is missing, so running the
	// action again could apply it twice); nothing ran, and the saga stops stuck with the
	// reason until an operator has checked.
	SagaOutcomeRefused = "refused"
)

// SagaPhase is the value of MetadataSagaPhase: whether a saga message belongs to a step's
// action or to its compensation.
type SagaPhase string

// The saga phases.
const (
	SagaPhaseAction       SagaPhase = "action"
	SagaPhaseCompensation SagaPhase = "compensation"
)

// SagaRef is the saga metadata of one message: which saga, step, phase and attempt it
// belongs to. Its zero Phase means SagaPhaseAction and its zero Attempt means 1.
type SagaRef struct {
	ID      string
	Step    string
	Phase   SagaPhase
	Attempt int
}

// ErrInvalidSagaMetadata is wrapped by SagaOf's error for a message whose saga metadata is
// present but incomplete or malformed.
var ErrInvalidSagaMetadata = errors.New("invalid saga metadata")

// SetSaga writes ref into msg's metadata (phase and attempt always explicit) and returns msg,
// for chaining.
func SetSaga(msg *message.Message, ref SagaRef) *message.Message {
	ref = ref.normalized()
	msg.Metadata.Set(MetadataSagaID, ref.ID)
	msg.Metadata.Set(MetadataSagaStep, ref.Step)
	msg.Metadata.Set(MetadataSagaPhase, string(ref.Phase))
	msg.Metadata.Set(MetadataSagaAttempt, strconv.Itoa(ref.Attempt))
	return msg
}

// SagaOf reads a message's saga metadata. ok is false when the message is not a saga message
// (no MetadataSagaID). A saga message with an empty id or step, an unknown phase or an
// attempt that is not a positive integer yields an error wrapping ErrInvalidSagaMetadata
// that lists every problem.
func SagaOf(msg *message.Message) (ref SagaRef, ok bool, err error) {
	id, ok := msg.Metadata[MetadataSagaID]
	if !ok {
		return SagaRef{}, false, nil
	}
	ref = SagaRef{ID: id, Step: msg.Metadata.Get(MetadataSagaStep), Phase: SagaPhase(msg.Metadata.Get(MetadataSagaPhase))}
	var problems []error
	if a, set := msg.Metadata[MetadataSagaAttempt]; set {
		n, convErr := strconv.Atoi(a)
		if convErr != nil || n < 1 {
			problems = append(problems, fmt.Errorf("metadata %q is %q; want a decimal integer >= 1", MetadataSagaAttempt, a))
		}
		ref.Attempt = n
	}
	if err := ref.Validate(); err != nil {
		problems = append(problems, err)
	}
	if len(problems) > 0 {
		return SagaRef{}, true, fmt.Errorf("%w: %w", ErrInvalidSagaMetadata, errors.Join(problems...))
	}
	return ref.normalized(), true, nil
}

// Validate reports every problem of ref: an empty id or step, an unknown phase, a negative
// attempt.
func (ref SagaRef) Validate() error {
	var problems []error
	if ref.ID == "" {
		problems = append(problems, fmt.Errorf("metadata %q is empty", MetadataSagaID))
	}
	if ref.Step == "" {
		problems = append(problems, fmt.Errorf("metadata %q is missing (a saga message is deduplicated by saga id + step + phase + attempt)", MetadataSagaStep))
	}
	switch ref.Phase {
	case "", SagaPhaseAction, SagaPhaseCompensation:
	default:
		problems = append(problems, fmt.Errorf("metadata %q is %q; want %q or %q", MetadataSagaPhase, ref.Phase, SagaPhaseAction, SagaPhaseCompensation))
	}
	if ref.Attempt < 0 {
		problems = append(problems, fmt.Errorf("attempt is %d; want 0 (meaning 1) or more", ref.Attempt))
	}
	return errors.Join(problems...)
}

func (ref SagaRef) normalized() SagaRef {
	if ref.Phase == "" {
		ref.Phase = SagaPhaseAction
	}
	if ref.Attempt == 0 {
		ref.Attempt = 1
	}
	return ref
}
