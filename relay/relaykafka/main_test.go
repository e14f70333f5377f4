package relaykafka_test

import (
	"testing"

	"github.com/onceflow/onceflow/internal/testutil"
)

// TestMain fails the run when a test leaves goroutines behind (a client or cluster not closed).
func TestMain(m *testing.M) { testutil.Main(m) }
