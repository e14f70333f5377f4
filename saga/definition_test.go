package saga_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/saga"
)

func build(c Checkout) (any, error) { return stepCmd{Order: c.Order}, nil }

func TestDefineRefusesInvalidDefinitions(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name  string
		steps []*saga.StepDef[Checkout]
		opts  []saga.Option
		want  []string
	}{
		{"no steps", nil, nil, []string{"no steps"}},
		{"duplicate names and no command", []*saga.StepDef[Checkout]{
			saga.Step[Checkout]("a").Send("t", build),
			saga.Step[Checkout]("a"),
			saga.Step[Checkout](""),
		}, nil, []string{`step 1 ("a"): duplicate step name`, `step 1 ("a"): no command`, `step 2 (""): name is empty`}},
		{"compensation on the pivot and after it", []*saga.StepDef[Checkout]{
			saga.Step[Checkout]("a").Send("t", build).Compensate("u", build),
			saga.Step[Checkout]("p").Send("t", build).Compensate("u", build).Pivot(),
			saga.Step[Checkout]("b").Send("t", build).Compensate("u", build),
		}, nil, []string{"a pivot step has no compensation", "steps after the pivot are retried until they succeed"}},
		{"two pivots, bad policy", []*saga.StepDef[Checkout]{
			saga.Step[Checkout]("p1").Send("t", build).Pivot().Attempts(0, -time.Second),
			saga.Step[Checkout]("p2").Send("t", build).Pivot().Timeout(-1),
		}, []saga.Option{saga.WithDeadline(-time.Second)}, []string{"a second pivot", "attempts is 0", "must not be negative", "deadline is -1s"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := saga.Define("checkout", 0, c.steps, c.opts...)
			var ce *saga.ConfigError
			if !errors.As(err, &ce) {
				t.Fatalf("err = %v, want a *ConfigError", err)
			}
			for _, want := range append(c.want, "version is 0") {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not mention %q", err, want)
				}
			}
		})
	}
}

func TestDefineAccessors(t *testing.T) {
	t.Parallel()
	def := saga.MustDefine("checkout", 2, []*saga.StepDef[Checkout]{
		saga.Step[Checkout]("reserve").Send("inventory.reserve", build).Compensate("inventory.release", build),
		saga.Step[Checkout]("charge").Send("payments.charge", build).Pivot(),
	}, saga.WithReplyTopic("checkout.events"))
	if def.Name() != "checkout" || def.Version() != 2 || def.ReplyTopic() != "checkout.events" || strings.Join(def.Steps(), ",") != "reserve,charge" {
		t.Fatalf("accessors: %s %d %s %v", def.Name(), def.Version(), def.ReplyTopic(), def.Steps())
	}
	if d := saga.MustDefine("x", 1, []*saga.StepDef[Checkout]{saga.Step[Checkout]("s").Send("t", build)}); d.ReplyTopic() != "x.replies" {
		t.Fatalf("default reply topic %q", d.ReplyTopic())
	}
}
