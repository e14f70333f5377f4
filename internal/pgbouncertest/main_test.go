package pgbouncertest_test

import (
	"testing"

	"github.com/onceflow/onceflow/internal/testdb"
)

// TestMain stops the test cluster and fails the run when a test leaves goroutines behind.
func TestMain(m *testing.M) { testdb.Main(m) }
