package saga_test

import (
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/saga"
)

// A participant's action that returns inbox.RetryAfter is answered at once as a retry carrying
// its wait: the participant's partition goes on, and the orchestrator re-sends the command no
// sooner than asked (the step's own backoff here is 10 ms), as the step's next attempt. The
// first attempt's writes were rolled back; the saga completes with each effect once.
func TestParticipantRetryAfter(t *testing.T) {
	forModes(t, func(t *testing.T, batched bool) {
		w := newWorldMode(t, batched, checkoutDef(t, nil))
		w.mu.Lock()
		w.later["charge"] = 1500 * time.Millisecond
		w.mu.Unlock()
		id := w.start("order-later")
		d := w.runUntil(id, saga.StateCompleted)
		w.mu.Lock()
		at := w.actionAt["charge"]
		w.mu.Unlock()
		if len(at) != 2 {
			t.Fatalf("charge's action ran %d times, want 2", len(at))
		}
		if gap := at[1].Sub(at[0]); gap < 1500*time.Millisecond {
			t.Errorf("the re-send came %s after the first attempt; the participant asked for 1.5 s", gap)
		}
		if got := strings.Join(w.effects(id), ","); got != "reserve/action,charge/action,confirm/action" {
			t.Errorf("effects %s", got)
		}
		for _, s := range d.Steps {
			if s.Name == "charge" && (s.Attempts != 2 || len(s.Replies) != 2 || s.Replies[0].Outcome != "retry" || s.Replies[0].Reason != "provider down") {
				t.Errorf("charge step: %+v", s)
			}
		}
	})
}
