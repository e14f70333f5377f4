package inbox_test

import (
	"errors"
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
		{"saga action", "u1", map[string]string{"saga_id": "s1", "saga_step": "reserve", "saga_phase": "action"}, `saga:"s1":"reserve":action`, ""},
		{"saga without phase is an action", "u2", map[string]string{"saga_id": "s1", "saga_step": "reserve"}, `saga:"s1":"reserve":action`, ""},
		{"saga compensation", "u3", map[string]string{"saga_id": "s1", "saga_step": "reserve", "saga_phase": "compensation"}, `saga:"s1":"reserve":compensation`, ""},
		{"saga quoting", "u4", map[string]string{"saga_id": `a":"b`, "saga_step": "c"}, `saga:"a\":\"b":"c":action`, ""},
		{"saga without step", "u5", map[string]string{"saga_id": "s1"}, "", `"saga_step" is missing`},
		{"empty saga id", "u6", map[string]string{"saga_id": "", "saga_step": "x"}, "", `"saga_id" is empty`},
		{"unknown phase", "u7", map[string]string{"saga_id": "s1", "saga_step": "x", "saga_phase": "undo"}, "", `"saga_phase" is "undo"`},
		{"every saga problem at once", "u8", map[string]string{"saga_id": "", "saga_phase": "undo"}, "", `"saga_id" is empty; metadata "saga_step" is missing`},
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
				if !errors.Is(err, inbox.ErrNoKey) || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("err = %v, want ErrNoKey mentioning %q", err, c.wantErr)
				}
				return
			}
			if err != nil || got != c.want {
				t.Fatalf("DefaultKey = %q, %v; want %q", got, err, c.want)
			}
		})
	}
}

// Saga keys must be injective: two different (saga id, step, phase) triples never share a
// key, or one step would be skipped as a duplicate of another. Event keys never collide with
// saga keys either.
func FuzzSagaKeyInjective(f *testing.F) {
	f.Add("s1", "reserve", "action", "s1", "reserve", "compensation")
	f.Add(`a":"b`, "c", "", "a", `b":"c`, "")
	f.Add("s", "a:b", "action", "s:a", "b", "action")
	f.Fuzz(func(t *testing.T, id1, step1, phase1, id2, step2, phase2 string) {
		k1, err1 := inbox.SagaKey(id1, step1, phase1)
		k2, err2 := inbox.SagaKey(id2, step2, phase2)
		if err1 != nil || err2 != nil {
			for _, err := range []error{err1, err2} {
				if err != nil && !errors.Is(err, inbox.ErrNoKey) {
					t.Fatalf("error %v does not wrap ErrNoKey", err)
				}
			}
			return
		}
		norm := func(p string) string {
			if p == "" {
				return inbox.PhaseAction
			}
			return p
		}
		same := id1 == id2 && step1 == step2 && norm(phase1) == norm(phase2)
		if (k1 == k2) != same {
			t.Fatalf("SagaKey(%q,%q,%q) = %q and SagaKey(%q,%q,%q) = %q", id1, step1, phase1, k1, id2, step2, phase2, k2)
		}
		if ek, err := inbox.EventKey(id1); err == nil && ek == k1 {
			t.Fatalf("event key %q equals saga key", ek)
		}
		// DefaultKey of a saga message is SagaKey of its metadata.
		msg := outbox.NewMessage(nil)
		msg.Metadata.Set(outbox.MetadataSagaID, id1)
		msg.Metadata.Set(outbox.MetadataSagaStep, step1)
		msg.Metadata.Set(outbox.MetadataSagaPhase, phase1)
		if dk, err := inbox.DefaultKey(msg); err != nil || dk != k1 {
			t.Fatalf("DefaultKey = %q, %v; SagaKey = %q", dk, err, k1)
		}
	})
}
