package testutil

import "testing"

// TestCheckLeaksSeesABlockedGoroutine makes sure the check every TestMain relies on reports a
// goroutine that outlives its test, and stops reporting it once it exits.
func TestCheckLeaksSeesABlockedGoroutine(t *testing.T) {
	release, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		<-release
	}()
	if err := CheckLeaks(); err == nil {
		t.Error("CheckLeaks found no leak while a goroutine was blocked")
	}
	close(release)
	<-done
	if err := CheckLeaks(); err != nil {
		t.Errorf("CheckLeaks after the goroutine exited: %v", err)
	}
}
