package saga

import "context"

// VersionsSQL is the statement Admin.Versions counts the sagas by version with.
func VersionsSQL(schema string) string { return versionsSQL(schema) }

// Beat records o in saga_orchestrator under id once, as each of Run's heartbeats does.
func Beat(ctx context.Context, o *Orchestrator, id string) { newRegistration(o, id).beat(ctx) }
