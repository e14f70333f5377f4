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
	var next atomic.Int64
	b.ResetTimer()
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				n := int(next.Add(1)) - 1
				if n >= b.N {
					return
				}
				msg := message.NewMessage(uuid.NewString(), []byte(`{}`))
				outbox.SetSaga(msg, outbox.SagaRef{ID: fmt.Sprint(n), Step: "a", Phase: outbox.SagaPhaseAction, Attempt: 1})
				msg.Metadata.Set(outbox.MetadataSagaName, "bench")
				msg.Metadata.Set(outbox.MetadataSagaOutcome, outbox.SagaOutcomeDone)
				if err := o.Handler(msg); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
}
