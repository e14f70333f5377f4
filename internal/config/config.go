// Package config is the one shape of onceflow's configuration errors: every constructor that
// validates a config reports all of its problems at once in an *Error, which each public
// package exports under the name ConfigError.
package config

import (
	"fmt"
	"strings"
	"time"
)

// Error lists every problem of one configuration, so all of them can be fixed at once.
type Error struct {
	// Scope names what was configured: "inbox", "relay", "idempotency cleaner", ...
	Scope string
	// Problems are the individual problems, each saying what to change.
	Problems []error
}

// Error lists every problem on one line: "inbox: invalid config: Pool is nil; ...".
func (e *Error) Error() string {
	parts := make([]string, len(e.Problems))
	for i, p := range e.Problems {
		parts[i] = p.Error()
	}
	return e.Scope + ": invalid config: " + strings.Join(parts, "; ")
}

// Unwrap returns the individual problems, for errors.Is and errors.As.
func (e *Error) Unwrap() []error { return e.Problems }

// Check returns nil when there are no problems, else an *Error. nil entries are dropped.
func Check(scope string, problems ...error) error {
	var ps []error
	for _, p := range problems {
		if p != nil {
			ps = append(ps, p)
		}
	}
	if len(ps) == 0 {
		return nil
	}
	return &Error{Scope: scope, Problems: ps}
}

// Default sets *v to def when it is zero and reports a problem, naming the field, when it is
// negative: the rule of every optional count and interval of onceflow's configs (0 means the
// default; a negative value is a mistake, never a silent default).
func Default[T int | time.Duration](field string, v *T, def T) error {
	switch {
	case *v < 0:
		return fmt.Errorf("%s is %v; use 0 for the default (%v) or a positive value", field, *v, def)
	case *v == 0:
		*v = def
	}
	return nil
}
