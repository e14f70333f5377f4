package inbox_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/outbox"
)

func TestDefaultKey(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name    string
		uuid    string
		meta    map[string]string
		want    string
		wantErr string
	}{
		{"event", "0193a5d2-7c4e-7b1a-9f00-1234567890ab", nil, "event:0193a5d2-7c4e-7b1a-9f00-1234567890ab", ""},
		{"any non-empty id", "order-42/v1", nil, "event:order-42/v1", ""},
		{"no uuid", "", nil, "", "message UUID is empty"},
		{"saga action", "u1", map[string]string{"saga_id": "s1", "saga_step": "reserve", "saga_phase": "action"}, `saga:"s1":"reserve":action:1`, ""},
		{"saga without phase is an action", "u2", map[string]string{"saga_id": "s1", "saga_step": "reserve"}, `saga:"s1":"reserve":action:1`, ""},
		{"saga compensation", "u3", map[string]string{"saga_id": "s1", "saga_step": "reserve", "saga_phase": "compensation"}, `saga:"s1":"reserve":compensation:1`, ""},
		{"saga quoting", "u4", map[string]string{"saga_id": `a":"b`, "saga_step": "c"}, `saga:"a\":\"b":"c":action:1`, ""},
		{"saga without step", "u5", map[string]string{"saga_id": "s1"}, "", `"saga_step" is missing`},
		{"empty saga id", "u6", map[string]string{"saga_id": "", "saga_step": "x"}, "", `"saga_id" is empty`},
		{"unknown phase", "u7", map[string]string{"saga_id": "s1", "saga_step": "x", "saga_phase": "undo"}, "", `"saga_phase" is "undo"`},
		{"every saga problem at once", "u8", map[string]string{"saga_id": "", "saga_phase": "undo", "saga_attempt": "0"}, "", `"saga_id" is empty|"saga_step" is missing|"saga_phase" is "undo"|"saga_attempt" is "0"`},
		{"saga attempt", "u9", map[string]string{"saga_id": "s1", "saga_step": "reserve", "saga_attempt": "3"}, `saga:"s1":"reserve":action:3`, ""},
		{"saga attempt not a number", "u10", map[string]string{"saga_id": "s1", "saga_step": "reserve", "saga_attempt": "two"}, "", `"saga_attempt" is "two"`},
		{"too long", strings.Repeat("x", inbox.MaxKeyBytes), nil, "", "over the 1024-byte limit"},
		{"invalid utf-8", "\xff", nil, "", "not valid UTF-8"},
		{"NUL", "a\x00", nil, "", "NUL"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			msg := message.NewMessage(c.uuid, nil)
			for k, v := range c.meta {
				msg.Metadata.Set(k, v)
			}
			got, err := inbox.DefaultKey(msg)
			if c.wantErr != "" {
				for _, want := range strings.Split(c.wantErr, "|") {
					if !errors.Is(err, inbox.ErrNoKey) || !strings.Contains(fmt.Sprint(err), want) {
						t.Fatalf("err = %v, want ErrNoKey mentioning %q", err, want)
					}
				}
				return
			}
			if err != nil || got != c.want {
				t.Fatalf("DefaultKey = %q, %v; want %q", got, err, c.want)
			}
		})
	}
}

// Saga keys must be injective: two different (saga id, step, phase, attempt) tuples never
// share a key, or one step would be skipped as a duplicate of another (or a deliberate re-send
// as a duplicate of the first attempt). Event keys never collide with saga keys either.
func FuzzSagaKeyInjective(f *testing.F) {
	f.Add("s1", "reserve", "action", 1, "s1", "reserve", "compensation", 1)
	f.Add(`a":"b`, "c", "", 0, "a", `b":"c`, "", 0)
	f.Add("s", "a:b", "action", 1, "s:a", "b", "action", 1)
	f.Add("s", "a", "action", 1, "s", "a", "action", 2)
	f.Add("s", "a", "", 0, "s", "a", "action", 1)
	f.Fuzz(func(t *testing.T, id1, step1, phase1 string, att1 int, id2, step2, phase2 string, att2 int) {
		r1 := outbox.SagaRef{ID: id1, Step: step1, Phase: outbox.SagaPhase(phase1), Attempt: att1}
		r2 := outbox.SagaRef{ID: id2, Step: step2, Phase: outbox.SagaPhase(phase2), Attempt: att2}
		k1, err1 := inbox.SagaKey(r1)
		k2, err2 := inbox.SagaKey(r2)
		if err1 != nil || err2 != nil {
			for _, err := range []error{err1, err2} {
				if err != nil && !errors.Is(err, inbox.ErrNoKey) {
					t.Fatalf("error %v does not wrap ErrNoKey", err)
				}
			}
			return
		}
		norm := func(r outbox.SagaRef) outbox.SagaRef {
			if r.Phase == "" {
				r.Phase = outbox.SagaPhaseAction
			}
			if r.Attempt == 0 {
				r.Attempt = 1
			}
			return r
		}
		same := norm(r1) == norm(r2)
		if (k1 == k2) != same {
			t.Fatalf("SagaKey(%+v) = %q and SagaKey(%+v) = %q", r1, k1, r2, k2)
		}
		if ek, err := inbox.EventKey(id1); err == nil && ek == k1 {
			t.Fatalf("event key %q equals saga key", ek)
		}
		// DefaultKey of a saga message is SagaKey of its metadata, written by SetSaga.
		msg := outbox.SetSaga(outbox.NewMessage(nil), r1)
		if dk, err := inbox.DefaultKey(msg); err != nil || dk != k1 {
			t.Fatalf("DefaultKey = %q, %v; SagaKey = %q", dk, err, k1)
		}
	})
}
