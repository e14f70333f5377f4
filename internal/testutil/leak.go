package testutil

import (
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// leakIgnores are background goroutines of third-party libraries that no API stops; a check
// that flagged them would fail every package that touches the library, and hide real leaks
// behind them. Each entry says why it cannot be stopped.
var leakIgnores = []goleak.Option{
	// sarama creates its metrics with rcrowley/go-metrics, whose meters share one package-level
	// ticker goroutine started on the first meter and never stopped (go-metrics has no Stop
	// for it). Every sarama client starts it; closing the client leaves it running.
	goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
}

// CheckLeaks reports goroutines still running besides the test runner's own, after giving
// goroutines that are on their way out a moment to finish. Known third-party background
// goroutines (see leakIgnores) and those matched by extra are not reported.
func CheckLeaks(extra ...goleak.Option) error {
	opts := append(append([]goleak.Option(nil), leakIgnores...), extra...)
	// goleak gives exiting goroutines about a second; on a loaded machine (-race, other
	// packages' tests in parallel) kfake's connection reader, on its way out after its cluster
	// closed, was once still runnable after it (CI, relay/relaykafka). Up to 5 looks.
	var err error
	for range 5 {
		if err = goleak.Find(opts...); err == nil {
			return nil
		}
		time.Sleep(time.Second)
	}
	return err
}

// Main runs the package's tests, then the stop functions (servers the package shares between
// tests, in the order given), then the leak check, and exits with the tests' code, or 1 when
// goroutines leaked. The check runs only after a passing run: a failed test often leaves
// goroutines behind, and their report would bury the failure. Use it from TestMain:
//
//	func TestMain(m *testing.M) { testutil.Main(m) }
//
// Packages that use internal/testdb call testdb.Main instead, which stops the database
// server before the check.
func Main(m *testing.M, stop ...func()) {
	os.Exit(Run(m, stop...))
}

// Run is Main without the exit, for a TestMain that has more to do afterwards.
func Run(m *testing.M, stop ...func()) int {
	code := m.Run()
	for _, f := range stop {
		f()
	}
	if code != 0 {
		return code
	}
	if err := CheckLeaks(); err != nil {
		fmt.Fprintf(os.Stderr, "goleak: goroutines still running after all tests passed (find the test with a per-test goleak.VerifyNone, or -run):\n%v\n", err)
		return 1
	}
	return 0
}
