package config_test

import (
	"errors"
	"testing"
	"time"

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

// Default fills a zero value and refuses a negative one, naming the field.
func TestDefault(t *testing.T) {
	d := time.Duration(0)
	if err := config.Default("LaneInterval", &d, time.Second); err != nil || d != time.Second {
		t.Errorf("zero: %v, %v", d, err)
	}
	n := 3
	if err := config.Default("LaneMaxAttempts", &n, 10); err != nil || n != 3 {
		t.Errorf("set: %v, %v", n, err)
	}
	n = -1
	if err := config.Default("LaneMaxAttempts", &n, 10); err == nil || err.Error() != "LaneMaxAttempts is -1; use 0 for the default (10) or a positive value" || n != -1 {
		t.Errorf("negative: %v, %v", n, err)
	}
}
