package saga

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/onceflow/onceflow/internal/pgsql"
)

// The orchestrator registry (migration 0017, table saga_orchestrator): every running
// Orchestrator.Run keeps one row with the definition versions registered with it, so
// Admin.Versions and `onceflow saga versions` can say which versions a deploy serves and which
// still have sagas alive.
const (
	// OrchestratorHeartbeat is how often Run refreshes its saga_orchestrator row (and the
	// definitions registered since it started). Fixed rather than configured: the row serves
	// the version listing, which needs seconds, not the timers' precision.
	OrchestratorHeartbeat = 10 * time.Second
	// OrchestratorExpiry is how long a row that is not refreshed counts as live: three
	// heartbeats, so one or two lost ones (a database failover, a long GC pause) do not make
	// a running orchestrator disappear. A process that died without stopping (crash,
	// SIGKILL) drops out of Admin.Versions this long after its last heartbeat, and the next
	// orchestrator to heartbeat deletes its row.
	OrchestratorExpiry = 3 * OrchestratorHeartbeat
	// orchestratorLeaveTimeout bounds the DELETE of the row when Run stops: its context is
	// over by then.
	orchestratorLeaveTimeout = 5 * time.Second
)

// DefinitionVersion names one version of a saga definition.
type DefinitionVersion struct {
	Name    string `json:"name"`
	Version int    `json:"version"`
}

// String is "name:version", the form ParseVersions reads.
func (v DefinitionVersion) String() string { return v.Name + ":" + strconv.Itoa(v.Version) }

// VersionsOf returns the names and versions of defs, sorted, without duplicates: for
// Admin.CheckVersions in a test or at start-up (any *Definition[D] is a Known).
func VersionsOf(defs ...Known) []DefinitionVersion {
	out := make([]DefinitionVersion, 0, len(defs))
	for _, d := range defs {
		if d != nil {
			out = append(out, DefinitionVersion{d.Name(), d.Version()})
		}
	}
	return sortVersions(out)
}

// FormatVersions is the list in the form ParseVersions reads and
// `onceflow saga versions --require-registered` takes: "checkout:1,checkout:2". A service can
// print it (FormatVersions(orch.Registered())) for its deploy pipeline to pass on.
func FormatVersions(vs []DefinitionVersion) string {
	parts := make([]string, len(vs))
	for i, v := range vs {
		parts[i] = v.String()
	}
	return strings.Join(parts, ",")
}

// ParseVersions reads a comma-separated list of name:version pairs ("checkout:1,refund:3"),
// as FormatVersions writes it; spaces around the pairs are ignored, duplicates are dropped.
// The name ends at the last colon; a name containing a comma cannot be listed this way. Every
// malformed pair is reported in one error.
func ParseVersions(s string) ([]DefinitionVersion, error) {
	if strings.TrimSpace(s) == "" {
		return nil, fmt.Errorf("saga: the version list is empty; list name:version pairs separated by commas (e.g. checkout:1,checkout:2)")
	}
	var out []DefinitionVersion
	var problems []string
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		i := strings.LastIndexByte(part, ':')
		if i < 0 {
			problems = append(problems, fmt.Sprintf("%q has no version (want name:version, e.g. checkout:2)", part))
			continue
		}
		name, ver := part[:i], part[i+1:]
		n, err := strconv.Atoi(ver)
		switch {
		case checkName("saga name", name) != nil:
			problems = append(problems, fmt.Sprintf("%q: %v", part, checkName("saga name", name)))
		case err != nil || n < 1:
			problems = append(problems, fmt.Sprintf("%q: version %q is not a positive whole number", part, ver))
		default:
			out = append(out, DefinitionVersion{name, n})
		}
	}
	if len(problems) > 0 {
		return nil, fmt.Errorf("saga: bad version list: %s", strings.Join(problems, "; "))
	}
	return sortVersions(out), nil
}

// sortVersions sorts vs by name and version and drops duplicates, in place.
func sortVersions(vs []DefinitionVersion) []DefinitionVersion {
	sort.Slice(vs, func(i, j int) bool {
		if vs[i].Name != vs[j].Name {
			return vs[i].Name < vs[j].Name
		}
		return vs[i].Version < vs[j].Version
	})
	out := vs[:0]
	for i, v := range vs {
		if i == 0 || v != vs[i-1] {
			out = append(out, v)
		}
	}
	return out
}

// Registered returns the definition versions registered with the orchestrator, sorted by
// name and version: what Run records in saga_orchestrator, and what a service passes to
// Admin.CheckVersions (or prints with FormatVersions for `onceflow saga versions
// --require-registered`).
func (o *Orchestrator) Registered() []DefinitionVersion {
	o.mu.RLock()
	out := make([]DefinitionVersion, 0, len(o.defs))
	for k := range o.defs {
		out = append(out, DefinitionVersion{k.name, k.version})
	}
	o.mu.RUnlock()
	return sortVersions(out)
}

// heartbeat records this Run in saga_orchestrator and refreshes the row every
// OrchestratorHeartbeat until ctx ends; the returned function, which Run defers, waits for it
// and deletes the row. It runs beside the timers and never holds them up: a failed heartbeat
// is logged and tried again at the next one.
func (o *Orchestrator) heartbeat(ctx context.Context) (stop func()) {
	r := newRegistration(o, rand.Text())
	hctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { r.loop(hctx) })
	return func() {
		cancel()
		wg.Wait()
		r.leave(context.WithoutCancel(ctx))
	}
}

// registration is one Run's row in saga_orchestrator.
type registration struct {
	o                 *Orchestrator
	id, host          string
	pid               int
	beatSQL, leaveSQL string
	failures          int // heartbeats failed in a row
}

func newRegistration(o *Orchestrator, id string) *registration {
	r := &registration{o: o, id: id, pid: os.Getpid()}
	r.host, _ = os.Hostname()
	r.beatSQL, r.leaveSQL = orchestratorSQL(o.cfg.Schema)
	return r
}

func (r *registration) loop(ctx context.Context) {
	t := time.NewTicker(OrchestratorHeartbeat)
	defer t.Stop()
	for {
		r.beat(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// beat upserts the row with the versions registered now, and deletes the rows of
// orchestrators whose expiry passed (they died without stopping), in one statement.
func (r *registration) beat(ctx context.Context) {
	o := r.o
	defs, err := json.Marshal(o.Registered())
	if err == nil {
		_, err = o.cfg.Pool.Exec(ctx, r.beatSQL, r.id, o.cfg.Consumer, r.host, r.pid, defs, OrchestratorExpiry.Seconds())
	}
	switch {
	case ctx.Err() != nil:
		// Run is stopping: the heartbeat it interrupted does not matter.
	case err != nil:
		r.failures++
		o.cfg.Logger.Warn("saga: recording this orchestrator in saga_orchestrator failed; timers fire regardless, "+
			"but `onceflow saga versions` does not list it until a heartbeat succeeds",
			"err", o.st.explain(err), "failures", r.failures, "retry_in", OrchestratorHeartbeat)
	case r.failures > 0:
		o.cfg.Logger.Info("saga: recording this orchestrator in saga_orchestrator works again", "failures", r.failures)
		r.failures = 0
	}
}

// leave deletes the row, with its own timeout: Run's context is over.
func (r *registration) leave(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, orchestratorLeaveTimeout)
	defer cancel()
	if _, err := r.o.cfg.Pool.Exec(ctx, r.leaveSQL, r.id); err != nil {
		r.o.cfg.Logger.Warn("saga: removing this orchestrator from saga_orchestrator failed; the row counts as gone once it expires",
			"err", r.o.st.explain(err), "expires_in", OrchestratorExpiry)
	}
}

// orchestratorSQL returns the registry's statements for the schema's saga_orchestrator.
func orchestratorSQL(schema string) (beat, leave string) {
	t := pgsql.Table(schema, "saga_orchestrator")
	beat = `WITH gone AS (DELETE FROM ` + t + ` WHERE expires_at < now() AND id <> $1)
		INSERT INTO ` + t + ` AS o (id, consumer, host, pid, definitions, expires_at)
		VALUES ($1, $2, $3, $4, $5, now() + make_interval(secs => $6::float8))
		ON CONFLICT (id) DO UPDATE SET definitions = EXCLUDED.definitions, seen_at = now(), expires_at = EXCLUDED.expires_at`
	leave = `DELETE FROM ` + t + ` WHERE id = $1`
	return beat, leave
}
