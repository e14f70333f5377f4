package inboxkafka_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
)

// The retry lane: the payment provider of customer "ann" is down, so her first charge asks to
// be retried later. Her second charge waits behind it, in order; "bob", on the same
// partition, is charged at once. When the first charge's time comes, the consumer applies
// ann's charges in order, each once.
func Example_retryLane() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{
		Kafka: onceflowtest.KafkaOptions{Topics: []string{"payments.requested"}, Partitions: 1},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	pool := env.Pool
	if _, err := pool.Exec(ctx, `CREATE TABLE charge (id bigserial PRIMARY KEY, customer text NOT NULL, what text NOT NULL)`); err != nil {
		fmt.Println(err)
		return
	}
	charge := func(customer, what string) *message.Message {
		return outbox.SetPartitionKey(outbox.NewMessage([]byte(what)), customer) // the key the relay publishes with
	}
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: env.Brokers, Marshaler: kafka.DefaultMarshaler{}}, watermill.NopLogger{})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := pub.Publish("payments.requested", charge("ann", "ann-1"), charge("ann", "ann-2"), charge("bob", "bob-1")); err != nil {
		fmt.Println(err)
		return
	}
	_ = pub.Close()

	errProviderDown := errors.New("payment provider unavailable")
	var annTries atomic.Int32
	ib, err := inbox.New(inbox.Config{Pool: pool, Consumer: "payments", LaneInterval: 100 * time.Millisecond})
	if err != nil {
		fmt.Println(err)
		return
	}
	handle := func(msg *message.Message) error {
		if string(msg.Payload) == "ann-1" && annTries.Add(1) == 1 {
			return inbox.RetryAfter(errProviderDown, 500*time.Millisecond) // ann waits; bob goes on
		}
		_, err := outbox.MustTx(msg.Context()).Exec(msg.Context(), `INSERT INTO charge (customer, what) VALUES ($1, $2)`,
			outbox.PartitionKey(msg), string(msg.Payload))
		return err
	}
	consumer, err := inboxkafka.NewBatchConsumer(inboxkafka.BatchConfig{
		Brokers: env.Brokers, Group: "payments", Topics: []string{"payments.requested"}, Processor: ib.BatchNoPublish(handle),
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- consumer.Run(runCtx) }()

	var order []string
	for deadline := time.Now().Add(time.Minute); len(order) < 3 && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		order = order[:0]
		rows, err := pool.Query(ctx, `SELECT what FROM charge ORDER BY id`)
		if err != nil {
			fmt.Println(err)
			break
		}
		for rows.Next() {
			var what string
			_ = rows.Scan(&what)
			order = append(order, what)
		}
		rows.Close()
	}
	stop()
	fmt.Println("run:", <-done)
	fmt.Println("charged:", strings.Join(order, ", "))
	// Output:
	// run: <nil>
	// charged: bob-1, ann-1, ann-2
}
