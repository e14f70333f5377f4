package testutil

import (
	"testing"
	"time"
)

// AwaitWithin polls cond until it holds, and fails the test with what and why() when it does
// not within limit: a test of something that used to hang (a retry forever) says what it found
// instead of running into the package's timeout.
func AwaitWithin(t testing.TB, limit time.Duration, what string, cond func() bool, why func() string) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %s: %s; %s", limit, what, why())
		}
		time.Sleep(10 * time.Millisecond)
	}
}
