// Package config is the one shape of onceflow's configuration errors: every constructor that
// validates a config reports all of its problems at once in an *Error, which each public
// package exports under the name ConfigError.
package config

import "strings"

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
