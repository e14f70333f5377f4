package saga

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgsql"
)

// VersionStatus is one definition version: its sagas that have not finished, and the live
// orchestrators that have it registered.
type VersionStatus struct {
	Name    string
	Version int
	// Running, Compensating and Stuck count the version's sagas in each state that is not
	// finished: each still needs the version registered with an orchestrator (a stuck one
	// for `onceflow saga retry`).
	Running, Compensating, Stuck int64
	// OldestID and OldestStartedAt are the version's oldest saga that has not finished; ""
	// and the zero time when there is none.
	OldestID        string
	OldestStartedAt time.Time
	// Orchestrators are the live orchestrators (Run heartbeating within OrchestratorExpiry)
	// that have the version registered, by host, pid and id; none when no running
	// orchestrator serves it.
	Orchestrators []OrchestratorInfo
}

// NotFinished is the count of the version's sagas that are running, compensating or stuck.
func (v VersionStatus) NotFinished() int64 { return v.Running + v.Compensating + v.Stuck }

// Key is the version's name and number.
func (v VersionStatus) Key() DefinitionVersion { return DefinitionVersion{v.Name, v.Version} }

// versionsSQL counts the sagas that have not finished by version and state, with the oldest:
// the counts by a hash aggregate of the unfinished rows alone (saga_state_idx; no sort of
// them), the oldest's id by one probe of saga_created_idx (created_at, id) per version.
// Measured at 300k sagas: 18 ms with 10k not finished, 120-150 ms with 100k; the finished
// rows are not visited, so no index of its own is needed (TestVersionsReadOnlyUnfinished).
func versionsSQL(schema string) string {
	sagaT := pgsql.Table(schema, "saga")
	return `SELECT g.name, g.version, g.running, g.compensating, g.stuck, o.id, o.created_at
		FROM (SELECT name, version,
				count(*) FILTER (WHERE state = 'running'), count(*) FILTER (WHERE state = 'compensating'),
				count(*) FILTER (WHERE state = 'stuck'), min(created_at)
			FROM ` + sagaT + ` WHERE state IN ('running', 'compensating', 'stuck') GROUP BY name, version)
			AS g (name, version, running, compensating, stuck, oldest)
		LEFT JOIN LATERAL (SELECT s.id, s.created_at FROM ` + sagaT + ` s
			WHERE s.created_at = g.oldest AND s.state IN ('running', 'compensating', 'stuck')
				AND s.name = g.name AND s.version = g.version
			ORDER BY s.id LIMIT 1) o ON true`
}

// OrchestratorInfo is a running orchestrator as its saga_orchestrator row records it.
type OrchestratorInfo struct {
	// ID is the token the orchestrator's Run drew when it started.
	ID       string
	Consumer string // OrchestratorConfig.Consumer
	Host     string
	PID      int
	// StartedAt is when Run recorded the row, SeenAt its last heartbeat (database clock).
	StartedAt, SeenAt time.Time
}

// Versions returns every definition version that has sagas not finished, or that a live
// orchestrator has registered (then possibly with none: what a deploy serves), sorted by name
// and version, with the counts per state, the oldest saga that has not finished, and the live
// orchestrators that have it registered.
//
// It reads only the sagas that have not finished, by saga_state_idx (state, name): the
// finished ones, which retention keeps by the million, are not visited; the oldest of each
// version is one index probe. Its cost grows with the sagas not finished (about 20 ms per 10k
// of them). Orchestrators are the saga_orchestrator rows whose expiry has not passed.
func (a *Admin) Versions(ctx context.Context, db DB) ([]VersionStatus, error) {
	rows, err := db.Query(ctx, versionsSQL(a.st.schema))
	if err != nil {
		return nil, fmt.Errorf("saga: count sagas by version: %w", a.st.explain(err))
	}
	byKey := map[DefinitionVersion]*VersionStatus{}
	var all []*VersionStatus
	add := func(k DefinitionVersion) *VersionStatus {
		v := byKey[k]
		if v == nil {
			v = &VersionStatus{Name: k.Name, Version: k.Version}
			byKey[k] = v
			all = append(all, v)
		}
		return v
	}
	var (
		k        DefinitionVersion
		n        [3]int64
		oldestID *string
		oldestAt *time.Time
	)
	if _, err := pgx.ForEachRow(rows, []any{&k.Name, &k.Version, &n[0], &n[1], &n[2], &oldestID, &oldestAt}, func() error {
		v := add(k)
		v.Running, v.Compensating, v.Stuck = n[0], n[1], n[2]
		if oldestID != nil && oldestAt != nil { // nil only when the oldest finished meanwhile
			v.OldestID, v.OldestStartedAt = *oldestID, *oldestAt
		}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("saga: count sagas by version: %w", a.st.explain(err))
	}

	rows, err = db.Query(ctx, `SELECT d.name, d.version, o.id, o.consumer, o.host, o.pid, o.started_at, o.seen_at
		FROM `+pgsql.Table(a.st.schema, "saga_orchestrator")+` o
		CROSS JOIN LATERAL jsonb_to_recordset(o.definitions) AS d (name text, version integer)
		WHERE o.expires_at > now() AND d.name IS NOT NULL AND d.version IS NOT NULL
		ORDER BY o.host, o.pid, o.id`)
	if err != nil {
		return nil, fmt.Errorf("saga: read the live orchestrators: %w", a.st.explain(err))
	}
	var oi OrchestratorInfo
	if _, err := pgx.ForEachRow(rows, []any{&k.Name, &k.Version, &oi.ID, &oi.Consumer, &oi.Host, &oi.PID, &oi.StartedAt, &oi.SeenAt}, func() error {
		v := add(k)
		v.Orchestrators = append(v.Orchestrators, oi)
		return nil
	}); err != nil {
		return nil, fmt.Errorf("saga: read the live orchestrators: %w", a.st.explain(err))
	}

	slices.SortFunc(all, func(x, y *VersionStatus) int {
		if c := strings.Compare(x.Name, y.Name); c != 0 {
			return c
		}
		return x.Version - y.Version
	})
	out := make([]VersionStatus, len(all))
	for i, v := range all {
		out[i] = *v
	}
	return out, nil
}

// ErrUnregisteredVersions is what an *UnregisteredVersionsError matches with errors.Is:
// sagas that have not finished run on definition versions missing from the list checked.
var ErrUnregisteredVersions = errors.New("saga: sagas that have not finished run on definition versions missing from the list")

// UnregisteredVersionsError is CheckVersions' failure: every version with sagas that have not
// finished that the list lacks. A build without these versions strands those sagas: no
// orchestrator of it can advance, retry or compensate them.
type UnregisteredVersionsError struct {
	Schema  string
	Missing []VersionStatus // sorted by name and version; each has NotFinished() > 0
}

// Error lists the missing versions with their counts and oldest saga, and says what to do.
func (e *UnregisteredVersionsError) Error() string {
	var b strings.Builder
	what, them := "a definition version", "it"
	if len(e.Missing) != 1 {
		what, them = fmt.Sprintf("%d definition versions", len(e.Missing)), "them"
	}
	fmt.Fprintf(&b, "saga: schema %q has sagas that have not finished on %s missing from the list: ", e.Schema, what)
	for i, v := range e.Missing {
		if i > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "%s (%d not finished: %d running, %d compensating, %d stuck", v.Key(), v.NotFinished(), v.Running, v.Compensating, v.Stuck)
		if v.OldestID != "" {
			fmt.Fprintf(&b, "; oldest %s, started %s", v.OldestID, v.OldestStartedAt.UTC().Format(time.RFC3339))
		}
		b.WriteString(")")
	}
	fmt.Fprintf(&b, ". Keep registering %s with the orchestrators (saga.Register) until `onceflow saga versions` shows no saga "+
		"not finished for %s: running and compensating sagas finish on their own (`onceflow saga compensate` ends a running one "+
		"sooner), stuck ones only after `onceflow saga retry`, which an orchestrator with the version carries out. "+
		"A build without %s strands these sagas", them, them, them)
	return b.String()
}

// Unwrap makes errors.Is(err, ErrUnregisteredVersions) true.
func (e *UnregisteredVersionsError) Unwrap() error { return ErrUnregisteredVersions }

// CheckVersions returns nil when every definition version that has sagas not finished
// (running, compensating or stuck) is in have, and an *UnregisteredVersionsError listing the
// others otherwise. Run it before a build that drops a version goes out — in a deploy
// pipeline, at a service's start-up or in its tests — with the versions the build registers:
// orch.Registered(), VersionsOf(defs...), or ParseVersions of `onceflow saga versions
// --require-registered`'s list. Versions without live sagas need not be in have.
func (a *Admin) CheckVersions(ctx context.Context, db DB, have []DefinitionVersion) error {
	vs, err := a.Versions(ctx, db)
	if err != nil {
		return err
	}
	known := map[DefinitionVersion]bool{}
	for _, v := range have {
		known[v] = true
	}
	var missing []VersionStatus
	for _, v := range vs {
		if v.NotFinished() > 0 && !known[v.Key()] {
			missing = append(missing, v)
		}
	}
	if len(missing) > 0 {
		return &UnregisteredVersionsError{Schema: a.st.schema, Missing: missing}
	}
	return nil
}
