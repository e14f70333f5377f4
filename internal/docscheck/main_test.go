package docscheck_test

import (
	"testing"

	"github.com/onceflow/onceflow/onceflowtest"
)

// TestMain stops the PostgreSQL the quickstart test started and checks for leaked goroutines.
func TestMain(m *testing.M) { onceflowtest.Main(m) }
