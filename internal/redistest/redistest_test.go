package redistest_test

import (
	"context"
	"testing"

	"github.com/onceflow/onceflow/internal/redistest"
)

func TestStartAndStop(t *testing.T) {
	ctx := context.Background()
	a, b := redistest.Start(t), redistest.Start(t)
	if a.Addr() == b.Addr() {
		t.Fatalf("two servers share %s", a.Addr())
	}
	ca, cb := a.Client(t), b.Client(t)
	if err := ca.Set(ctx, "k", "a", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if n, err := cb.Exists(ctx, "k").Result(); err != nil || n != 0 {
		t.Fatalf("servers are not isolated: exists=%d err=%v", n, err)
	}
	a.Stop()
	a.Stop() // idempotent
	if err := ca.Ping(ctx).Err(); err == nil {
		t.Fatal("stopped server still answers")
	}
	if err := cb.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
}
