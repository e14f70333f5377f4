package main

import (
	"context"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/onceflow/onceflow/onceflowtest"
)

// TestMain fails the run when the demo leaves goroutines behind.
func TestMain(m *testing.M) { onceflowtest.Main(m) }

// TestDemo runs a shortened `make demo-core`: a real
// onceflow binary killed mid-stream, replayed duplicates, and every invariant checked.
func TestDemo(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "onceflow")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/onceflow/onceflow/cmd/onceflow").CombinedOutput(); err != nil {
		t.Fatalf("build onceflow: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ok, err := run(ctx, options{
		binary: bin, events: 1500, accounts: 20, producers: 3, duration: 3 * time.Second,
		replayRate: 0.1, kills: 1, timeout: 60 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	if !ok {
		t.Fatal("an invariant failed; see the table above")
	}
}
