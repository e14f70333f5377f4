package inboxkafka_test

import (
	"os"
	"testing"

	"github.com/onceflow/onceflow/internal/testdb"
)

// TestMain runs the tests on a shared embedded PostgreSQL (or DATABASE_URL) and fails the run
// when a test leaves goroutines behind. The kill test re-executes this binary as a consumer
// process it can SIGKILL.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(childMain())
	}
	testdb.Main(m)
}
