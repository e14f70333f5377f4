package saga_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

type benchCmd struct {
	N int `json:"n"`
}

// BenchmarkParticipantAction: a participant's per-message path (saga.Action: the batch engine
// with a batch of one) on commands of distinct sagas from 8 goroutines, each command one INSERT.
// It measures the engine alone, without Kafka: go test -run XXX -bench ParticipantAction ./saga/
func BenchmarkParticipantAction(b *testing.B) {
	db := testdb.New(b)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE `+db.Schema+`.effect (saga text PRIMARY KEY)`); err != nil {
		b.Fatal(err)
	}
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		b.Fatal(err)
	}
	p, err := saga.NewParticipant(saga.ParticipantConfig{Pool: db.Pool, Schema: db.Schema, Consumer: "bench", Writer: w})
	if err != nil {
		b.Fatal(err)
	}
	h := saga.Action(p, func(ctx context.Context, tx pgx.Tx, c benchCmd) (struct{}, error) {
		_, err := tx.Exec(ctx, `INSERT INTO `+db.Schema+`.effect (saga) VALUES ($1)`, fmt.Sprint(c.N))
		return struct{}{}, err
	})
	handleEach(b, func(n int) error {
		msg := message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf(`{"n":%d}`, n)))
		outbox.SetSaga(msg, outbox.SagaRef{ID: fmt.Sprint(n), Step: "reserve", Phase: outbox.SagaPhaseAction, Attempt: 1})
		msg.Metadata.Set(outbox.MetadataSagaReplyTo, "bench.replies")
		msg.Metadata.Set(outbox.MetadataSagaName, "bench")
		return h(msg)
	})
}

type orchBenchData struct {
	N int `json:"n"`
}

// BenchmarkOrchestratorReply: the orchestrator's per-message path (Orchestrator.Handler: the
// batch engine with a batch of one) applying the first step's reply of b.N two-step sagas from
// 8 goroutines: each reply locks its saga, sends the next command and moves the saga on. It
// measures the engine alone, without Kafka: go test -run XXX -bench OrchestratorReply ./saga/
func BenchmarkOrchestratorReply(b *testing.B) {
	db := testdb.New(b)
	ctx := context.Background()
	build := func(d orchBenchData) (any, error) { return d, nil }
	def := saga.MustDefine("bench", 1, []*saga.StepDef[orchBenchData]{
		saga.Step[orchBenchData]("a").Send("bench.a", build).Compensate("bench.undo-a", build),
		saga.Step[orchBenchData]("b").Send("bench.b", build),
	})
	o, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: db.Pool, Schema: db.Schema})
	if err != nil {
		b.Fatal(err)
	}
	if err := saga.Register(o, def); err != nil {
		b.Fatal(err)
	}
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		b.Fatal(err)
	}
	for n := range b.N {
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			_, err := saga.StartTx(ctx, tx, def, orchBenchData{N: n}, saga.WithID(fmt.Sprint(n)), saga.WithWriter(w))
			return err
		}); err != nil {
			b.Fatal(err)
		}
	}
	wal := walPerOp(b, db)
	handleEach(b, func(n int) error {
		msg := message.NewMessage(uuid.NewString(), []byte(`{}`))
		outbox.SetSaga(msg, outbox.SagaRef{ID: fmt.Sprint(n), Step: "a", Phase: outbox.SagaPhaseAction, Attempt: 1})
		msg.Metadata.Set(outbox.MetadataSagaName, "bench")
		msg.Metadata.Set(outbox.MetadataSagaOutcome, outbox.SagaOutcomeDone)
		return o.Handler(msg)
	})
	wal()
}

// BenchmarkOrchestratorReplyBatch: the orchestrator's batched path (Orchestrator.ProcessBatch,
// as inboxkafka.BatchConsumer calls it) applying the first step's reply of b.N two-step sagas
// in batches of 100 from 2 goroutines (an op is one reply): each batch claims its replies,
// locks its sagas, and writes every saga row and every next command (one outbox statement) in
// one transaction. go test -run XXX -bench OrchestratorReplyBatch ./saga/
func BenchmarkOrchestratorReplyBatch(b *testing.B) {
	const batch = 100
	db := testdb.New(b)
	ctx := context.Background()
	build := func(d orchBenchData) (any, error) { return d, nil }
	def := saga.MustDefine("bench", 1, []*saga.StepDef[orchBenchData]{
		saga.Step[orchBenchData]("a").Send("bench.a", build).Compensate("bench.undo-a", build),
		saga.Step[orchBenchData]("b").Send("bench.b", build),
	})
	o, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: db.Pool, Schema: db.Schema})
	if err != nil {
		b.Fatal(err)
	}
	if err := saga.Register(o, def); err != nil {
		b.Fatal(err)
	}
	w, err := outbox.NewWriter(outbox.Config{Schema: db.Schema})
	if err != nil {
		b.Fatal(err)
	}
	batches := (b.N + batch - 1) / batch
	for from := 0; from < batches*batch; from += 500 {
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			for n := from; n < min(from+500, batches*batch); n++ {
				if _, err := saga.StartTx(ctx, tx, def, orchBenchData{N: n}, saga.WithID(fmt.Sprint(n)), saga.WithWriter(w)); err != nil {
					return err
				}
			}
			return nil
		}); err != nil {
			b.Fatal(err)
		}
	}
	wal := walPerOp(b, db)
	var next atomic.Int64
	b.ResetTimer()
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			for {
				k := int(next.Add(1)) - 1
				if k >= batches {
					return
				}
				msgs := make([]*message.Message, batch)
				for i := range msgs {
					msg := message.NewMessage(uuid.NewString(), []byte(`{}`))
					outbox.SetSaga(msg, outbox.SagaRef{ID: fmt.Sprint(k*batch + i), Step: "a", Phase: outbox.SagaPhaseAction, Attempt: 1})
					msg.Metadata.Set(outbox.MetadataSagaName, "bench")
					msg.Metadata.Set(outbox.MetadataSagaOutcome, outbox.SagaOutcomeDone)
					msgs[i] = msg
				}
				if err := o.ProcessBatch(ctx, msgs); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	wal()
}

// walPerOp reports the WAL written from now to the returned function's call, per op: a cost
// that other load on the machine does not change, unlike ns/op (the throwaway test server
// serves nothing else; a DATABASE_URL server's other clients would add their WAL).
func walPerOp(b *testing.B, db *testdb.DB) func() {
	ctx := context.Background()
	var from string
	if err := db.Pool.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&from); err != nil {
		b.Fatal(err)
	}
	return func() {
		var bytes float64
		if err := db.Pool.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn() - $1::pg_lsn`, from).Scan(&bytes); err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(bytes/float64(b.N), "WAL-B/op")
	}
}

// handleEach calls handle for n = 0 … b.N-1 from 8 goroutines, after resetting the timer.
func handleEach(b *testing.B, handle func(n int) error) {
	var next atomic.Int64
	b.ResetTimer()
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for {
				n := int(next.Add(1)) - 1
				if n >= b.N {
					return
				}
				if err := handle(n); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
}
