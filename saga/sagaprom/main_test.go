package sagaprom_test

import (
	"testing"

	"github.com/onceflow/onceflow/internal/testdb"
)

// TestMain stops the test PostgreSQL (if one was started) and fails the run when a test
// leaves goroutines behind.
func TestMain(m *testing.M) { testdb.Main(m) }
