package relay

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"time"
)

// TopicError is an undeliverable refusal of a whole topic: it does not exist (and the broker
// does not create it), or the relay's principal may not write to it. Every row of the topic
// would be refused the same way, so after one refusal the relay stops sending the topic for a
// backoff (its rows, and the later rows of their keys, wait; every other topic flows at full
// speed) instead of letting each batch wait for the broker to refuse it again. Every refusal
// counts an attempt, with the error, for each waiting row of the topic (sent, or held back
// because the topic was closed), and the rows are parked at the Config.MaxAttempts-th
// refusal, in step (docs/relay.md, "Topics", states the bound). Sinks return it through
// UnwritableTopic.
type TopicError struct {
	Topic string
	Err   error
}

// Error names the topic and the broker's error.
func (e *TopicError) Error() string {
	return fmt.Sprintf("topic %q cannot be written (create it, or grant the relay write access): %v", e.Topic, e.Err)
}

// Unwrap returns the broker's error.
func (e *TopicError) Unwrap() error { return e.Err }

// UnwritableTopic wraps err, the broker's refusal of topic as a whole (UNKNOWN_TOPIC_OR_PARTITION,
// TOPIC_AUTHORIZATION_FAILED), as an undeliverable TopicError.
func UnwritableTopic(topic string, err error) error {
	if err == nil {
		return nil
	}
	return Undeliverable(&TopicError{Topic: topic, Err: err})
}

// topicGate remembers the topics the broker refused as a whole and until when the relay does
// not send them. Only the publishing loop uses it.
//
// A refused topic's rows move in step: every refusal of the topic counts one attempt for each
// of its pending rows that heads its chain, whether the row was in the refused send or held
// back because the topic was closed (claimed after the refusal, or due while another claim
// had just probed the topic), and they all wait for the topic's reopening, not for backoffs of
// their own. So every such row is tried at every reopening and parked at the latest at the
// MaxAttempts-th refusal after it was first claimed (docs/relay.md, "Topics"), instead of
// falling a whole backoff behind when it missed a reopening.
type topicGate struct {
	base, max time.Duration
	closed    map[string]*closedTopic
}

type closedTopic struct {
	until    time.Time
	failures int // refusals in a row: the generation of err
	err      error
	// counted maps a row id to the refusal (failures) its attempts last counted, so a row
	// looked at several times while the topic stays closed counts each refusal once.
	counted map[int64]int
}

func newTopicGate(base, max time.Duration) *topicGate {
	return &topicGate{base: base, max: max, closed: map[string]*closedTopic{}}
}

// refused records a refusal of topic and closes it for a backoff that grows with every
// refusal in a row. It returns the topic's state after the refusal.
func (g *topicGate) refused(topic string, err error, now time.Time) *closedTopic {
	c, ok := g.closed[topic]
	if !ok {
		c = &closedTopic{counted: map[int64]int{}}
		g.closed[topic] = c
	}
	c.failures++
	c.err = err
	c.until = now.Add(backoffDelay(g.base, g.max, c.failures, rand.Float64()))
	return c
}

// delivered reopens topic: the broker acknowledged a row of it.
func (g *topicGate) delivered(topic string) { delete(g.closed, topic) }

// closedFor returns the state of topic while it is not sent (nil when it may be sent).
func (g *topicGate) closedFor(topic string, now time.Time) *closedTopic {
	if c, ok := g.closed[topic]; ok && c.until.After(now) {
		return c
	}
	return nil
}

// known reports whether topic was refused as a whole and has not delivered since.
func (g *topicGate) known(topic string) bool {
	_, ok := g.closed[topic]
	return ok
}

// count reports whether row id has not yet counted the topic's latest refusal, and marks it
// counted.
func (c *closedTopic) count(id int64) bool {
	if c.counted[id] >= c.failures {
		return false
	}
	c.counted[id] = c.failures
	return true
}

// forget drops a row that left the outbox (parked).
func (g *topicGate) forget(topic string, id int64) {
	if c, ok := g.closed[topic]; ok {
		delete(c.counted, id)
	}
}

// topicOf returns the topic of a TopicError in err.
func topicOf(err error) (string, bool) {
	var te *TopicError
	if errors.As(err, &te) {
		return te.Topic, true
	}
	return "", false
}
