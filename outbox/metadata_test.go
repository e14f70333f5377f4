package outbox_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/outbox"
)

func TestSagaMetadataRoundTrip(t *testing.T) {
	t.Parallel()
	cases := []struct {
		in, want outbox.SagaRef
	}{
		{outbox.SagaRef{ID: "s", Step: "reserve"}, outbox.SagaRef{ID: "s", Step: "reserve", Phase: outbox.SagaPhaseAction, Attempt: 1}},
		{outbox.SagaRef{ID: "s", Step: "reserve", Phase: outbox.SagaPhaseCompensation, Attempt: 3},
			outbox.SagaRef{ID: "s", Step: "reserve", Phase: outbox.SagaPhaseCompensation, Attempt: 3}},
	}
	for _, c := range cases {
		msg := outbox.SetSaga(outbox.NewMessage(nil), c.in)
		got, ok, err := outbox.SagaOf(msg)
		if err != nil || !ok || got != c.want {
			t.Errorf("SagaOf(SetSaga(%+v)) = %+v, %v, %v; want %+v", c.in, got, ok, err, c.want)
		}
	}
	if _, ok, err := outbox.SagaOf(outbox.NewMessage(nil)); ok || err != nil {
		t.Errorf("plain message: ok=%v err=%v", ok, err)
	}
}

func TestSagaOfReportsEveryProblem(t *testing.T) {
	t.Parallel()
	msg := outbox.NewMessage(nil)
	msg.Metadata.Set(outbox.MetadataSagaID, "")
	msg.Metadata.Set(outbox.MetadataSagaPhase, "undo")
	msg.Metadata.Set(outbox.MetadataSagaAttempt, "-1")
	_, ok, err := outbox.SagaOf(msg)
	if !ok || !errors.Is(err, outbox.ErrInvalidSagaMetadata) {
		t.Fatalf("ok=%v err=%v, want ErrInvalidSagaMetadata", ok, err)
	}
	for _, want := range []string{`"saga_id" is empty`, `"saga_step" is missing`, `"saga_phase" is "undo"`, `"saga_attempt" is "-1"`} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %s", err, want)
		}
	}
}
