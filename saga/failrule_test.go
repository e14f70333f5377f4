package saga_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/saga"
)

// Issue 33: errors that look like network errors but come from the handler — an HTTP
// client's *url.Error, a handler deadline (context.DeadlineExceeded), a decoder's io.EOF —
// are the message's, not the database's: a participant answers the command as a failed
// attempt after its MaxAttempts, a local step uses its attempts and the saga compensates, a
// failing OnReplyTx fails its step. Each test bounds its wait (the bug made each of them wait
// forever) and says what it found.

// refusedURL returns the URL of a local port nothing listens on: an http.Get of it fails at
// once with "connection refused" (a *url.Error, which is a net.Error).
func refusedURL(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return "http://" + addr + "/charge"
}

// callProvider is what a participant's action does with a payment provider: an HTTP call
// whose error it returns as it is.
func callProvider(ctx context.Context, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	_ = resp.Body.Close()
	return fmt.Errorf("the provider answered %s", resp.Status)
}

// A participant whose action calls a payment provider that is down (connection refused, an
// *url.Error) for one saga, with ParticipantConfig.MaxAttempts 2, ahead of 19 others on a
// one-partition topic: the command is answered as a failed attempt carrying the error after
// 2 tries, the saga re-sends the step for its attempts (3) and then compensates, and the other
// sagas complete. (It used to be taken for the database's failure: retried forever without
// counting an attempt, no reply, every saga behind it stalled.)
func TestParticipantHTTPErrorIsAFailedAttempt(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		w := newWorldMode(t, batched, checkoutDef(t, nil))
		w.maxAttempts = 2
		url := refusedURL(t)
		var providerCalls atomic.Int32
		// Probe once, so the test says so if this machine does not refuse the port.
		if err := callProvider(context.Background(), url); err == nil || !strings.Contains(err.Error(), "refused") {
			t.Fatalf("the probe of a closed port returned %v, want connection refused", err)
		}
		action := func(name string) func(context.Context, pgx.Tx, stepCmd) (stepResult, error) {
			h := w.action(name)
			if name != "charge" {
				return h
			}
			return func(ctx context.Context, tx pgx.Tx, cmd stepCmd) (stepResult, error) {
				if cmd.Order == "o-000" {
					providerCalls.Add(1)
					return stepResult{}, callProvider(ctx, url)
				}
				return h(ctx, tx, cmd)
			}
		}
		stop := w.throughKafkaWith(kafkatest.Brokers(t, 1), action)
		defer stop()
		var ids []string
		for i := range 20 {
			ids = append(ids, w.start(fmt.Sprintf("o-%03d", i)))
		}
		w.waitFinishedWithin(ids, 30*time.Second, func() string {
			return fmt.Sprintf("the provider was called %d times for o-000 (with MaxAttempts 2 and 3 step attempts it should be called 6 times, "+
				"then the saga compensates): a *url.Error was taken for the database's failure and retried without counting an attempt", providerCalls.Load())
		})
		for i, id := range ids {
			d := w.get(id)
			if i > 0 {
				if d.State != saga.StateCompleted {
					t.Errorf("saga %s: %s (%q), want completed", id, d.State, d.Error)
				}
				continue
			}
			if d.State != saga.StateCompensated {
				t.Fatalf("saga o-000: %s (%q), want compensated after charge's attempts", d.State, d.Error)
			}
			if !strings.Contains(d.Steps[1].LastError+d.Error, "connection refused") {
				t.Errorf("saga o-000: error %q, charge's last error %q; want the provider's connection refused", d.Error, d.Steps[1].LastError)
			}
			if d.Steps[1].Attempts != 3 {
				t.Errorf("charge was sent %d times, want its 3 attempts before compensating", d.Steps[1].Attempts)
			}
			if got := strings.Join(w.effects(id), " "); got != "reserve/action reserve/compensation" {
				t.Errorf("saga o-000's effects %q, want reserve's action and compensation", got)
			}
		}
		if n := providerCalls.Load(); n != 6 {
			t.Errorf("the provider was called %d times for o-000, want 2 tries (MaxAttempts) × 3 attempts = 6", n)
		}
		if s := w.metrics.Snapshot(); s.StepErrors != 3 {
			t.Errorf("metrics %+v: want 3 commands answered as failed (one per attempt of charge)", s)
		}
	})
}

// A local step whose action returns a deadline of its own (a call with a context timeout,
// wrapped: context.DeadlineExceeded satisfies net.Error) fails the step: its 3 attempts, then
// the saga compensates. (It used to be taken for the database's failure: the transition was
// tried again forever and the saga never moved.)
func TestLocalStepDeadlineIsTheStepsFailure(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		var calls atomic.Int32
		w := newLocalWorld(t, batched, []string{"reserve", "+note", "charge"}, func(name string, s *saga.StepDef[Checkout]) {
			if name == "note" {
				s.Local(func(ctx context.Context, tx pgx.Tx, c *Checkout) error {
					calls.Add(1)
					return fmt.Errorf("ledger service: %w", context.DeadlineExceeded)
				}).Attempts(3, 10*time.Millisecond)
			}
		})
		id := w.start("o-1")
		d := w.runUntilWithin(id, 30*time.Second, func() string {
			return fmt.Sprintf("the local step ran %d times (want its 3 attempts, then compensation): a wrapped context.DeadlineExceeded "+
				"was taken for the database's failure", calls.Load())
		}, saga.StateCompleted, saga.StateCompensated, saga.StateStuck)
		if d.State != saga.StateCompensated {
			t.Fatalf("state %s (%q), want compensated after note's attempts", d.State, d.Error)
		}
		if got, want := w.effects(id), []string{"reserve/action", "reserve/compensation"}; !slices.Equal(got, want) {
			t.Errorf("effects %v, want %v", got, want)
		}
		if n := calls.Load(); n != 3 || d.Steps[1].Attempts != 3 {
			t.Errorf("note ran %d times, %d attempts recorded; want 3 and 3", n, d.Steps[1].Attempts)
		}
		if !strings.Contains(d.Steps[1].LastError+d.Error, "deadline exceeded") {
			t.Errorf("error %q, note's last error %q; want the step's deadline", d.Error, d.Steps[1].LastError)
		}
	})
}

// An OnReplyTx handler that decodes an empty body with json.NewDecoder (io.EOF) fails its
// step like any of its errors: the step is compensated. (io.EOF used to be taken for a lost
// connection: the transition was tried again forever.)
func TestOnReplyTxDecodeEOFIsTheStepsFailure(t *testing.T) {
	t.Parallel()
	forModes(t, func(t *testing.T, batched bool) {
		var calls atomic.Int32
		def := replyTxDef(t, func(ctx context.Context, tx pgx.Tx, c *Checkout, r saga.Reply) error {
			calls.Add(1)
			var v struct{ ID string }
			return json.NewDecoder(bytes.NewReader(nil)).Decode(&v) // io.EOF
		})
		w := newWorldMode(t, batched, def)
		id := w.start("o-1")
		d := w.runUntilWithin(id, 30*time.Second, func() string {
			return fmt.Sprintf("OnReplyTx ran %d times: its io.EOF was taken for a lost connection", calls.Load())
		}, saga.StateCompleted, saga.StateCompensated, saga.StateStuck)
		if d.State != saga.StateCompensated || !strings.Contains(d.Error, io.EOF.Error()) {
			t.Fatalf("state %s (%q), want compensated with the handler's EOF", d.State, d.Error)
		}
		if got, want := w.effects(id), []string{"reserve/action", "reserve/compensation"}; !slices.Equal(got, want) {
			t.Errorf("effects %v, want %v", got, want)
		}
	})
}

// runUntilWithin is runUntil bounded by limit: a handler that retries forever gets its
// context ended, and the test fails with why() instead of hanging.
func (w *world) runUntilWithin(id string, limit time.Duration, why func() string, states ...saga.State) *saga.Detail {
	w.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	var last *saga.Detail
	err := w.bus.RunUntil(ctx, func() bool {
		last = w.get(id)
		return slices.Contains(states, last.State)
	})
	if err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("not finished within %s: %w", limit, err)
		}
		w.t.Fatalf("saga %s: %v (last state %s at step %s, error %q, steps %s); %s", id, err, last.State, last.Step, last.Error, statuses(last), why())
	}
	return last
}

// waitFinishedWithin is waitFinished with a diagnosis of the stall.
func (w *world) waitFinishedWithin(ids []string, limit time.Duration, why func() string) {
	w.t.Helper()
	deadline := time.Now().Add(limit)
	for _, id := range ids {
		for {
			d := w.get(id)
			if d.State.Finished() {
				break
			}
			if time.Now().After(deadline) {
				w.t.Fatalf("saga %s still %s at step %s (%s) after %s; %s", id, d.State, d.Step, statuses(d), limit, why())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}
