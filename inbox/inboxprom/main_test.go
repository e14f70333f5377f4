package inboxprom_test

import (
	"testing"

	"github.com/onceflow/onceflow/internal/testdb"
)

// TestMain stops the test cluster, if a test started one, and fails the run when a test
// leaves goroutines behind.
func TestMain(m *testing.M) { testdb.Main(m) }
