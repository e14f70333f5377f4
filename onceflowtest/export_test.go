package onceflowtest

// WithDatabase is withDatabase, for the table test.
var WithDatabase = withDatabase

// SetStandalone makes Start behave as outside a test binary (its own server, stopped by
// Close) and returns the function that undoes it.
func SetStandalone(v bool) (undo func()) {
	old := standalone
	standalone = v
	return func() { standalone = old }
}
