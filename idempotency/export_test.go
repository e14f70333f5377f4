package idempotency

// Test-only access to internals.

// LockID exposes the advisory lock key of (schema, owner, key).
var LockID = lockID

// SetAfterStore installs a hook that runs between storing a record and the commit.
func (m *Middleware) SetAfterStore(f func()) { m.afterStore = f }

// CanonicalJSON exposes the canonical JSON encoder.
var CanonicalJSON = canonicalJSON

// Fingerprint exposes the fingerprint function.
var Fingerprint = fingerprint

// Waiters is the number of requests waiting for a key held by another request.
func (m *Middleware) Waiters() int { return len(m.waitSlots) }
