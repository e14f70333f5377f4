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
	var next atomic.Int64
	b.ResetTimer()
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				n := int(next.Add(1))
				if n > b.N {
					return
				}
				msg := message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf(`{"n":%d}`, n)))
				outbox.SetSaga(msg, outbox.SagaRef{ID: fmt.Sprint(n), Step: "reserve", Phase: outbox.SagaPhaseAction, Attempt: 1})
				msg.Metadata.Set(outbox.MetadataSagaReplyTo, "bench.replies")
				msg.Metadata.Set(outbox.MetadataSagaName, "bench")
				if err := h(msg); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
}
