// Package sagatest runs sagas in a single process for tests: Bus stands in for the relay and
// the broker, handing the outbox rows that orchestrators and participants write to the
// handlers subscribed to their topics, in outbox order, and firing due timers — so a test
// drives a saga to its end with real PostgreSQL transactions and no Kafka.
//
//	bus := sagatest.NewBus(pool, schema)
//	bus.Subscribe("inventory.reserve", saga.Action(inventory, reserve))
//	bus.Subscribe(def.ReplyTopic(), orch.Handler)
//	id, _ := saga.StartTx(ctx, tx, def, data) // ... commit
//	err := bus.RunUntil(ctx, func() bool { return finished(id) })
//
// The handlers see each message once per delivery; DeliverTwice duplicates every delivery,
// to check that duplicates change nothing. SubscribeBatch and OrchestrateBatched hand the
// pending messages of a topic to an inbox.BatchProcessor (saga.ActionProcessor, an
// orchestrator) in one batch, as inboxkafka.BatchConsumer does.
package sagatest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/engine"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/saga"
)

// Bus delivers outbox rows to subscribed handlers. It is not safe for concurrent use.
type Bus struct {
	pool     *pgxpool.Pool
	schema   string
	handlers map[string][]func(*message.Message) error
	batches  map[string][]inbox.BatchProcessor
	orchs    []*saga.Orchestrator
	// DeliverTwice hands every message to its handlers twice (two copies with the same UUID
	// and metadata), like a broker redelivering it.
	DeliverTwice bool
	// Concurrent hands the copies of a message (every handler of its topic, twice with
	// DeliverTwice) over at the same time, each in its own goroutine, like a rebalance that
	// gives one message to two consumers — subscribe two orchestrators or two participant
	// instances to a topic to race them.
	Concurrent bool
	// Delivered counts the messages handed to handlers (copies included).
	Delivered int
}

// NewBus returns a bus over the outbox of schema ("" for the default, "onceflow", as every
// Config's Schema). It panics on a schema name that is not a plain identifier: a test's
// mistake, reported where it is made.
func NewBus(pool *pgxpool.Pool, schema string) *Bus {
	if schema == "" {
		schema = pgsql.DefaultSchema
	}
	if err := pgsql.ValidateSchema(schema); err != nil {
		panic("sagatest.NewBus: " + err.Error())
	}
	return &Bus{pool: pool, schema: schema, handlers: map[string][]func(*message.Message) error{}, batches: map[string][]inbox.BatchProcessor{}}
}

// SubscribeBatch hands the messages written to topic to p, all those pending at a Deliver in
// one ProcessBatch call (each twice in a row with DeliverTwice; the copies as two batches at
// once with Concurrent).
func (b *Bus) SubscribeBatch(topic string, p inbox.BatchProcessor) {
	b.batches[topic] = append(b.batches[topic], p)
}

// OrchestrateBatched is Orchestrate with o consuming its replies in batches (SubscribeBatch).
func (b *Bus) OrchestrateBatched(o *saga.Orchestrator) {
	for _, t := range o.ReplyTopics() {
		b.SubscribeBatch(t, o)
	}
	b.orchs = append(b.orchs, o)
}

// Subscribe hands every message written to topic to h (Action, Compensation, or an
// orchestrator's Handler).
func (b *Bus) Subscribe(topic string, h func(*message.Message) error) {
	b.handlers[topic] = append(b.handlers[topic], h)
}

// Orchestrate subscribes o.Handler to o's reply topics and lets Deliver fire o's due timers.
func (b *Bus) Orchestrate(o *saga.Orchestrator) {
	for _, t := range o.ReplyTopics() {
		b.Subscribe(t, o.Handler)
	}
	b.orchs = append(b.orchs, o)
}

// Deliver applies the orchestrators' parked replies (Orchestrator.RedriveParked) and fires
// their due timers, then hands every outbox row pending now to the handlers of its
// topic, in outbox order, deleting each row once its handlers succeeded. It returns how many
// rows it delivered. A handler error stops it and is returned; that row stays pending. A batch
// that fails as a whole (not a *inbox.MessageError) is retried first, as the batched
// consumer does.
// Rows of topics nobody subscribed to are left in the outbox.
func (b *Bus) Deliver(ctx context.Context) (int, error) {
	for _, o := range b.orchs {
		if _, err := o.RedriveParked(ctx); err != nil {
			return 0, err
		}
		if _, err := o.FireDue(ctx); err != nil {
			return 0, err
		}
	}
	outbox := pgsql.Table(b.schema, "outbox")
	rows, err := b.pool.Query(ctx, `SELECT id, event_id::text, topic, payload, metadata FROM `+outbox+` ORDER BY id`)
	if err != nil {
		return 0, err
	}
	type row struct {
		id    int64
		msg   *message.Message
		topic string
	}
	pending, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
		var x row
		var eventID string
		var payload []byte
		var md map[string]string
		if err := r.Scan(&x.id, &eventID, &x.topic, &payload, &md); err != nil {
			return x, err
		}
		x.msg = message.NewMessage(eventID, payload)
		for k, v := range md {
			x.msg.Metadata.Set(k, v)
		}
		return x, nil
	})
	if err != nil {
		return 0, err
	}
	n := 0
	batched := map[string][]row{}
	var topics []string // of batched, in the order first seen
	for _, r := range pending {
		if len(b.batches[r.topic]) > 0 {
			if batched[r.topic] == nil {
				topics = append(topics, r.topic)
			}
			batched[r.topic] = append(batched[r.topic], r)
			continue
		}
		hs := b.handlers[r.topic]
		if len(hs) == 0 {
			continue
		}
		copies := 1
		if b.DeliverTwice {
			copies = 2
		}
		var deliveries []func() error
		for _, h := range hs {
			for range copies {
				m := r.msg.Copy()
				m.SetContext(ctx)
				deliveries = append(deliveries, func() error { return h(m) })
			}
		}
		b.Delivered += len(deliveries)
		if err := b.run(deliveries); err != nil {
			return n, fmt.Errorf("sagatest: handler of %q failed on message %s: %w", r.topic, r.msg.UUID, err)
		}
		if _, err := b.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = $1`, r.id); err != nil {
			return n, err
		}
		n++
	}
	for _, topic := range topics {
		rs := batched[topic]
		var deliveries []func() error
		var ids []int64
		for _, r := range rs {
			ids = append(ids, r.id)
		}
		for _, p := range b.batches[topic] {
			copies := [][]*message.Message{nil}
			if b.DeliverTwice && b.Concurrent {
				copies = append(copies, nil)
			}
			for c := range copies {
				for _, r := range rs {
					for range 1 + boolInt(b.DeliverTwice && !b.Concurrent) {
						m := r.msg.Copy()
						m.SetContext(ctx)
						copies[c] = append(copies[c], m)
					}
				}
				batch := copies[c]
				b.Delivered += len(batch)
				deliveries = append(deliveries, func() error { return processBatch(ctx, p, batch) })
			}
		}
		if err := b.run(deliveries); err != nil {
			return n, fmt.Errorf("sagatest: batch of %d messages of %q failed: %w", len(rs), topic, err)
		}
		if _, err := b.pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE id = ANY($1)`, ids); err != nil {
			return n, err
		}
		n += len(rs)
	}
	return n, nil
}

func boolInt(v bool) int {
	if v {
		return 1
	}
	return 0
}

// processBatch hands a batch to p as inboxkafka.BatchConsumer does: a failure of the batch as a
// whole (a deadlock, a lock timeout, a lost connection: not a *inbox.MessageError) counts no
// attempt and is retried with the consumers' policy (engine.RetryPolicy.Refused) — here at most
// 20 times, then returned.
func processBatch(ctx context.Context, p inbox.BatchProcessor, batch []*message.Message) error {
	policy := engine.NewRetryPolicy(0, 10*time.Millisecond, 100*time.Millisecond, slog.New(slog.DiscardHandler))
	for failures := 0; ; failures++ {
		err := p.ProcessBatch(ctx, batch)
		var me *inbox.MessageError
		if err == nil || errors.As(err, &me) || failures >= 19 || errors.Is(err, migrations.ErrNotMigrated) {
			return err
		}
		if !policy.Refused(ctx, failures, len(batch), "sagatest", err) {
			return ctx.Err()
		}
	}
}

// run calls the deliveries one after the other, or all at once when Concurrent is set.
func (b *Bus) run(deliveries []func() error) error {
	if !b.Concurrent {
		for _, d := range deliveries {
			if err := d(); err != nil {
				return err
			}
		}
		return nil
	}
	errs := make([]error, len(deliveries))
	var wg sync.WaitGroup
	for i, d := range deliveries {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = d() }()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// ErrTimeout is returned by RunUntil when done did not become true in time.
var ErrTimeout = errors.New("sagatest: condition not reached in time")

// RunUntil calls Deliver until done returns true, waiting briefly whenever nothing was
// pending (timers may be due later), for at most a minute or until ctx ends.
func (b *Bus) RunUntil(ctx context.Context, done func() bool) error {
	deadline := time.Now().Add(time.Minute)
	for !done() {
		if time.Now().After(deadline) {
			return ErrTimeout
		}
		n, err := b.Deliver(ctx)
		if err != nil {
			return err
		}
		if n == 0 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(20 * time.Millisecond):
			}
		}
	}
	return nil
}
