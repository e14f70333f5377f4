package inboxkafka_test

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
)

// A batched consumer applies many messages of a partition in one transaction. The handler is
// the one you would give the router — here an audit log writer; ib.Batch runs it for each new
// message of a batch, in order, and commits once. Duplicates (the same event id published
// twice) are skipped, as with the middleware.
func ExampleNewBatchConsumer() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{
		Kafka: onceflowtest.KafkaOptions{Topics: []string{"orders.placed"}},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	pool := env.Pool
	if _, err := pool.Exec(ctx, `CREATE TABLE audit_log (event_id text PRIMARY KEY, topic text NOT NULL, payload bytea NOT NULL)`); err != nil {
		fmt.Println(err)
		return
	}

	// Three orders, the second published twice (a producer's retry).
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: env.Brokers, Marshaler: kafka.DefaultMarshaler{}}, watermill.NopLogger{})
	if err != nil {
		fmt.Println(err)
		return
	}
	orders := []*message.Message{outbox.NewMessage([]byte(`{"order":1}`)), outbox.NewMessage([]byte(`{"order":2}`)), outbox.NewMessage([]byte(`{"order":3}`))}
	if err := pub.Publish("orders.placed", orders[0], orders[1], orders[1], orders[2]); err != nil {
		fmt.Println(err)
		return
	}
	_ = pub.Close()

	audit := func(msg *message.Message) error {
		// The batch's transaction, as under the router's inbox middleware; the record's topic,
		// as the router gives it.
		_, err := outbox.MustTx(msg.Context()).Exec(msg.Context(), `INSERT INTO audit_log (event_id, topic, payload) VALUES ($1, $2, $3)`,
			msg.UUID, message.SubscribeTopicFromCtx(msg.Context()), msg.Payload)
		return err
	}
	ib, err := inbox.New(inbox.Config{Pool: pool, Consumer: "audit"})
	if err != nil {
		fmt.Println(err)
		return
	}
	consumer, err := inboxkafka.NewBatchConsumer(inboxkafka.BatchConfig{
		Brokers:   env.Brokers,
		Group:     "audit",
		Topics:    []string{"orders.placed"},
		Processor: ib.BatchNoPublish(audit),
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- consumer.Run(runCtx) }()

	var n int
	for deadline := time.Now().Add(time.Minute); n < 3 && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM audit_log`).Scan(&n)
	}
	stop()
	fmt.Println("run:", <-done)
	var topic string
	_ = pool.QueryRow(ctx, `SELECT count(*), min(topic) FROM audit_log`).Scan(&n, &topic)
	fmt.Println("audited:", n, "from", topic)
	// Output:
	// run: <nil>
	// audited: 3 from orders.placed
}
