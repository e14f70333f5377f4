package main

import (
	"context"
	"log/slog"
	"os"
	"testing"

	"github.com/onceflow/onceflow/onceflowtest"
)

// TestMain fails the run when the program leaves goroutines behind.
func TestMain(m *testing.M) { onceflowtest.Main(m) }

// TestProgram runs the program docs/sagas.md quotes, on a fresh database and an in-process
// Kafka: order-1 completes, order-2 (declined) is compensated and its stock released.
func TestProgram(t *testing.T) {
	db := onceflowtest.NewDB(t)
	t.Setenv("DATABASE_URL", db.DatabaseURL)
	t.Setenv("KAFKA_BROKERS", "") // the program's in-process kfake, even when a real Kafka is configured
	if err := run(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var completed, compensated, stock, payments int
	if err := db.Pool.QueryRow(ctx, `SELECT
			(SELECT count(*) FROM onceflow.saga WHERE id = 'order-1' AND state = 'completed'),
			(SELECT count(*) FROM onceflow.saga WHERE id = 'order-2' AND state = 'compensated'),
			(SELECT quantity FROM stock WHERE sku = 'book'),
			(SELECT count(*) FROM payment)`).Scan(&completed, &compensated, &stock, &payments); err != nil {
		t.Fatal(err)
	}
	if completed != 1 || compensated != 1 || stock != 8 || payments != 1 {
		t.Errorf("order-1 completed: %d, order-2 compensated: %d, books left: %d (want 8), payments: %d (want 1)",
			completed, compensated, stock, payments)
	}
}
