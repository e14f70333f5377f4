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
// speed) instead of letting each batch wait for the broker to refuse it again. The rows that
// were sent and refused count attempts and record the error, and are parked after
// Config.MaxAttempts refusals like any undeliverable row. Sinks return it through
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
type topicGate struct {
	base, max time.Duration
	closed    map[string]*closedTopic
}

type closedTopic struct {
	until    time.Time
	failures int
	err      error
}

func newTopicGate(base, max time.Duration) *topicGate {
	return &topicGate{base: base, max: max, closed: map[string]*closedTopic{}}
}

// refused records a refusal of topic and closes it for a backoff that grows with every
// refusal in a row.
func (g *topicGate) refused(topic string, err error, now time.Time) {
	c, ok := g.closed[topic]
	if !ok {
		c = &closedTopic{}
		g.closed[topic] = c
	}
	c.failures++
	c.err = err
	c.until = now.Add(backoffDelay(g.base, g.max, c.failures, rand.Float64()))
}

// delivered reopens topic: the broker acknowledged a row of it.
func (g *topicGate) delivered(topic string) { delete(g.closed, topic) }

// closedUntil returns until when topic is not sent (the zero time when it may be sent).
func (g *topicGate) closedUntil(topic string, now time.Time) time.Time {
	if c, ok := g.closed[topic]; ok && c.until.After(now) {
		return c.until
	}
	return time.Time{}
}

// known reports whether topic was refused as a whole and has not delivered since.
func (g *topicGate) known(topic string) bool {
	_, ok := g.closed[topic]
	return ok
}

// topicOf returns the topic of a TopicError in err.
func topicOf(err error) (string, bool) {
	var te *TopicError
	if errors.As(err, &te) {
		return te.Topic, true
	}
	return "", false
}
