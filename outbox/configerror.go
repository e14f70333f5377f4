package outbox

import "github.com/onceflow/onceflow/internal/config"

// ConfigError is returned by this package's constructors for an invalid config. It lists
// every problem at once: Scope names what was configured and Problems holds one error per
// problem, each saying what to change; Error() puts them on one line. It is the same type in
// every onceflow package (outbox, inbox, idempotency, relay), so errors.As with any of them
// matches.
type ConfigError = config.Error
