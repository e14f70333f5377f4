package testutil

import "testing"

// TestMain fails the run when a test leaves goroutines behind.
func TestMain(m *testing.M) { Main(m) }
