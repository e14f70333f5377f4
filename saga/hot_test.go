package saga_test

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/inbox/inboxkafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/pgsql"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/relay/relaykafka"
	"github.com/onceflow/onceflow/saga"
)

// The checkout of docs/sagas.md on batched consumers, with hot rows: every order holds two of
// five SKUs, and its reserve (and its release) updates their stock rows in the order's item
// order, so batches of different partitions update the same rows in different orders and
// PostgreSQL breaks their deadlocks. Two consumers per group (as two processes per
// participant would), four partitions per topic, 600 sagas started by 8 writers at once, every
// sixth declined at charge, no fault injected: the deadlocks are the batches' failures,
// retried without counting attempts, so exactly the planned sagas compensate, no step times
// out, and the stock adds up.
func TestHotStockRowsOnBatchedConsumers(t *testing.T) {
	t.Parallel()
	const sagas, skus = 600, 5
	// docs/sagas.md's checkout: reserve waits 30 s for its reply, the others 10 s.
	def := checkoutDef(t, func(name string, s *saga.StepDef[Checkout]) {
		s.Timeout(10 * time.Second)
		if name == "reserve" {
			s.Timeout(30 * time.Second)
		}
	})
	w := newWorldMode(t, true, def, "!reserve", "!charge", "!confirm") // wired below, through Kafka
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stock := w.db.Schema + ".stock"
	if _, err := w.db.Pool.Exec(ctx, `CREATE TABLE `+stock+` (sku int PRIMARY KEY, reserved int NOT NULL DEFAULT 0)`); err != nil {
		t.Fatal(err)
	}
	if _, err := w.db.Pool.Exec(ctx, `INSERT INTO `+stock+` (sku) SELECT generate_series(0, $1::int - 1)`, skus); err != nil {
		t.Fatal(err)
	}
	// itemsOf is an order's two SKUs, in its item order.
	itemsOf := func(order string) [2]int {
		h := fnv.New32a()
		_, _ = h.Write([]byte(order))
		a := int(h.Sum32() % skus)
		return [2]int{a, (a + 1 + int(h.Sum32()/skus%(skus-1))) % skus}
	}
	update := func(ctx context.Context, tx pgx.Tx, order string, by int) error {
		for _, sku := range itemsOf(order) {
			if _, err := tx.Exec(ctx, `UPDATE `+stock+` SET reserved = reserved + $2 WHERE sku = $1`, sku, by); err != nil {
				return err
			}
		}
		return nil
	}
	reserve := w.action("reserve")
	hotReserve := func(ctx context.Context, tx pgx.Tx, cmd stepCmd) (stepResult, error) {
		if err := update(ctx, tx, cmd.Order, 1); err != nil {
			return stepResult{}, err
		}
		return reserve(ctx, tx, cmd)
	}
	release := w.compensation("reserve")
	hotRelease := func(ctx context.Context, tx pgx.Tx, cmd stepCmd) error {
		if err := update(ctx, tx, cmd.Order, -1); err != nil {
			return err
		}
		return release(ctx, tx, cmd)
	}

	brokers := kafkatest.Brokers(t, 4)
	sink, err := relaykafka.NewSink(relaykafka.Config{Brokers: brokers})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sink.Close() }()
	r, err := relay.New(relay.Config{Pool: w.db.Pool, Sink: sink, Schema: w.db.Schema, PollInterval: 20 * time.Millisecond, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	var done []chan error
	goRun := func(run func(context.Context) error) {
		ch := make(chan error, 1)
		go func() { ch <- run(ctx) }()
		done = append(done, ch)
	}
	goRun(r.Run)
	goRun(w.orch.Run)
	var conflicts, blamed atomic.Int64
	consume := func(group string, p inbox.BatchProcessor, topics ...string) {
		p = &watchBlame{BatchProcessor: p, conflicts: &conflicts, blamed: &blamed}
		for range 2 { // two processes of one service
			c, err := inboxkafka.NewBatchConsumer(inboxkafka.BatchConfig{Brokers: brokers, Group: group, Topics: topics, Processor: p,
				Logger: quietLogger()})
			if err != nil {
				t.Fatal(err)
			}
			goRun(c.Run)
		}
	}
	for _, name := range stepNames {
		p := w.participant(name)
		action, comp := w.action(name), w.compensation(name)
		if name == "reserve" {
			action, comp = hotReserve, hotRelease
		}
		consume("svc-"+name, saga.ActionProcessor(p, action), "cmd."+name)
		consume("undo-"+name, saga.CompensationProcessor(p, comp), "undo."+name)
	}
	consume("orchestrator", w.orch, w.orch.ReplyTopics()...)

	ids := make([]string, sagas)
	declined := map[string]bool{}
	for i := range ids {
		ids[i] = fmt.Sprintf("o-%03d", i)
		if i%6 == 5 {
			declined[ids[i]] = true
			w.mu.Lock()
			w.failOrder[ids[i]] = "charge"
			w.mu.Unlock()
		}
	}
	var writers sync.WaitGroup
	for g := range 8 {
		writers.Go(func() {
			for i := g; i < sagas; i += 8 {
				w.start(ids[i])
			}
		})
	}
	writers.Wait()
	w.waitFinished(ids, 4*time.Minute)
	cancel()
	for _, ch := range done {
		if err := <-ch; err != nil {
			t.Error(err)
		}
	}

	perSKU := make([]int, skus)
	deadlocks := w.count(`SELECT deadlocks::int FROM pg_stat_database WHERE datname = current_database()`)
	t.Logf("deadlocks detected by PostgreSQL in the test database: %d; batches that failed on a conflict: %d", deadlocks, conflicts.Load())
	if n := blamed.Load(); n > 0 {
		t.Errorf("%d conflicts with concurrent transactions were blamed on a message (counted as its attempt)", n)
	}
	var wrong []string
	for _, id := range ids {
		d := w.get(id)
		want := saga.StateCompleted
		if declined[id] {
			want = saga.StateCompensated
		} else {
			for _, sku := range itemsOf(id) {
				perSKU[sku]++
			}
		}
		if d.State != want {
			wrong = append(wrong, fmt.Sprintf("%s %s (%s)", id, d.State, d.Error))
		}
		for _, s := range d.Steps {
			if strings.Contains(s.LastError, "timed out") {
				t.Errorf("saga %s: step %s timed out: %s", id, s.Name, s.LastError)
			}
		}
	}
	if len(wrong) > 0 {
		t.Errorf("%d of %d sagas did not end as planned (%d declined): %s", len(wrong), sagas, len(declined), strings.Join(wrong[:min(10, len(wrong))], "; "))
	}
	for sku, want := range perSKU {
		if got := w.count(`SELECT reserved FROM `+stock+` WHERE sku = $1`, sku); got != want {
			t.Errorf("sku %d: %d reserved, want %d (the completed sagas' reservations)", sku, got, want)
		}
	}
	if n := w.count(`SELECT count(*) FROM ` + w.db.Schema + `.inbox_poison`); n != 0 {
		t.Errorf("%d messages given up as poison", n)
	}
}

// watchBlame counts the batches that failed on a conflict with a concurrent transaction, and
// those where such a conflict was blamed on a message (a *inbox.MessageError): a deadlock is
// the batch's failure, never a message's.
type watchBlame struct {
	inbox.BatchProcessor
	conflicts, blamed *atomic.Int64
}

func (p *watchBlame) ProcessBatch(ctx context.Context, msgs []*message.Message) error {
	err := p.BatchProcessor.ProcessBatch(ctx, msgs)
	var me *inbox.MessageError
	var pgErr *pgconn.PgError
	conflict := errors.As(err, &pgErr) && (pgErr.Code == "40P01" || pgErr.Code == "40001")
	if conflict || errors.Is(err, pgsql.ErrTxAborted) {
		p.conflicts.Add(1)
		if errors.As(err, &me) {
			p.blamed.Add(1)
		}
	}
	return err
}
