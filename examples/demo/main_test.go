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

// TestDemo runs a shortened `make demo`, so that the README's first command cannot rot: the
// four services and three relays as processes, a relay and a participant SIGKILLed, injected
// duplicates, provider outages (charges retried later), reminders scheduled and withdrawn,
// lost dedup rows, and every invariant checked. Then, on the same binaries, a shortened
// `make demo-ha` (subtest "ha"): the same shop on a primary and a synchronous standby, whose
// primary is killed mid-stream and the standby promoted; every invariant holds.
func TestDemo(t *testing.T) {
	if testing.Short() {
		t.Skip("builds five binaries and runs the shop twice for about 15s each")
	}
	bin := t.TempDir()
	build := exec.Command("go", "build", "-o", filepath.Join(bin, "onceflow"), "github.com/onceflow/onceflow/cmd/onceflow")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build onceflow: %v\n%s", err, out)
	}
	build = exec.Command("go", "build", "-o", filepath.Join(bin, "examples")+"/",
		"github.com/onceflow/onceflow/examples/orders", "github.com/onceflow/onceflow/examples/inventory",
		"github.com/onceflow/onceflow/examples/payments", "github.com/onceflow/onceflow/examples/projection")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the examples: %v\n%s", err, out)
	}
	for _, ha := range []bool{false, true} {
		name := map[bool]string{false: "single", true: "ha"}[ha]
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			ok, err := run(ctx, options{bin: bin, ordersPerCustomer: 10, duration: 3 * time.Second, replay: 0.1,
				limit: 20_000, lostDedup: 2, remindAfter: 2 * time.Second, outage: 600 * time.Millisecond, retryAfter: 750 * time.Millisecond,
				timeout: 60 * time.Second, ha: ha})
			if err != nil {
				t.Fatal(err)
			}
			if !ok {
				t.Fatal("an invariant failed; see the table above")
			}
		})
	}
}
