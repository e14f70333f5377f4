package kafkarecord_test

import (
	"testing"

	"github.com/onceflow/onceflow/internal/testutil"
)

// TestMain fails the run when a test leaves goroutines behind.
func TestMain(m *testing.M) { testutil.Main(m) }
