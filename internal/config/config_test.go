package config_test

import (
	"errors"
	"testing"

	"github.com/onceflow/onceflow/internal/config"
)

func TestCheck(t *testing.T) {
	if err := config.Check("inbox", nil, nil); err != nil {
		t.Fatalf("no problems: %v", err)
	}
	sentinel := errors.New("Pool is nil")
	err := config.Check("inbox", sentinel, nil, errors.New("Consumer is empty"))
	var ce *config.Error
	if !errors.As(err, &ce) || len(ce.Problems) != 2 || ce.Scope != "inbox" {
		t.Fatalf("err = %#v", err)
	}
	if got, want := err.Error(), "inbox: invalid config: Pool is nil; Consumer is empty"; got != want {
		t.Fatalf("Error() = %q, want %q", got, want)
	}
	if !errors.Is(err, sentinel) {
		t.Fatal("errors.Is does not reach a problem")
	}
}
