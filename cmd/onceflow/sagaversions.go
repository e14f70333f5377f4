package main

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/onceflow/onceflow/saga"
)

// exitVersionsMissing is the status of `saga versions --require-registered` when a version
// with sagas not finished is missing from the list: the check failed (as `status` exits 4
// when something is stuck), told apart from 1, could not look.
const exitVersionsMissing = 4

const sagaVersionsSynopsis = `saga versions [flags]

Lists every saga definition version that has sagas not finished (running, compensating or
stuck), or that a running orchestrator has registered: the count in each state, the oldest
saga, and the live orchestrators that serve it (each records itself while its Run runs,
refreshed every 10s, and counts as gone 30s after its last heartbeat). Remove a version from
a build only once it shows no saga not finished.

--require-registered checks a build before it goes out: give it the versions the build
registers (name:version, comma-separated; the flag may repeat). It exits 4, listing every
version with sagas not finished that the list lacks, 0 when none does.`

// versionList is --require-registered: name:version pairs, comma-separated, the flag
// repeatable.
type versionList struct {
	set  bool
	list []saga.DefinitionVersion
}

func (v *versionList) String() string {
	if v == nil {
		return ""
	}
	return saga.FormatVersions(v.list)
}

func (v *versionList) Set(s string) error {
	vs, err := saga.ParseVersions(s)
	if err != nil {
		return errors.New(strings.TrimPrefix(err.Error(), "saga: "))
	}
	v.set = true
	v.list = append(v.list, vs...)
	return nil
}

func (c *cli) sagaVersions(ctx context.Context, args []string) error {
	fs := c.newFlagSet("saga versions", sagaVersionsSynopsis)
	db := c.addDBFlags(fs)
	var require versionList
	fs.Var(&require, "require-registered", "`name:version,...` the build registers (e.g. checkout:1,checkout:2): exit 4 when a version with sagas not finished is missing from it")
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(c.stderr, "onceflow saga versions: unexpected arguments %q\n", fs.Args())
		return errUsage
	}
	admin, err := saga.NewAdmin(db.schema)
	if err != nil {
		return err
	}
	// A schema without saga_orchestrator (migration 0017) is refused with the command to run.
	pool, err := db.connectMigrated(ctx, "onceflow-saga")
	if err != nil {
		return err
	}
	defer pool.Close()
	vs, err := admin.Versions(ctx, pool)
	if err != nil {
		return err
	}
	if err := c.printVersions(vs); err != nil {
		return err
	}
	if !require.set {
		return nil
	}
	// The check reads again: what it reports is the state when it ran.
	err = admin.CheckVersions(ctx, pool, require.list)
	if errors.Is(err, saga.ErrUnregisteredVersions) {
		return &exitError{code: exitVersionsMissing, err: err}
	}
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(c.stdout, "\nok: every version with sagas not finished is in --require-registered (%s)\n", saga.FormatVersions(require.list))
	return err
}

// printVersions prints the versions, a warning for each version whose sagas no live
// orchestrator serves, and the live orchestrators.
func (c *cli) printVersions(vs []saga.VersionStatus) error {
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	p := &printer{w: tw}
	if len(vs) == 0 {
		p.f("no saga versions: no saga is running, compensating or stuck, and no orchestrator runs\n")
		return p.flush(tw)
	}
	p.f("NAME\tVERSION\tRUNNING\tCOMPENSATING\tSTUCK\tOLDEST\tOLDEST STARTED\tORCHESTRATORS\n")
	orchs := map[string]saga.OrchestratorInfo{}
	var unserved []string
	for _, v := range vs {
		names := make([]string, 0, len(v.Orchestrators))
		for _, o := range v.Orchestrators {
			names = append(names, o.Host+":"+strconv.Itoa(o.PID))
			orchs[o.ID] = o
		}
		served := strings.Join(names, ", ")
		if served == "" {
			served = "none"
			if v.NotFinished() > 0 {
				unserved = append(unserved, fmt.Sprintf("%s has %s not finished and no live orchestrator registers it: "+
					"nothing advances, retries or compensates them until one with the version runs", v.Key(), plural(int(v.NotFinished()), "saga")))
			}
		}
		oldest, started := "-", "-"
		if v.OldestID != "" {
			oldest, started = v.OldestID, fmtTime(v.OldestStartedAt)
		}
		p.f("%s\t%d\t%d\t%d\t%d\t%s\t%s\t%s\n", v.Name, v.Version, v.Running, v.Compensating, v.Stuck, oldest, started, served)
	}
	if len(unserved) > 0 {
		p.f("\n")
	}
	for _, u := range unserved {
		p.f("! %s\n", u)
	}
	if len(orchs) > 0 {
		list := make([]saga.OrchestratorInfo, 0, len(orchs))
		for _, o := range orchs {
			list = append(list, o)
		}
		sort.Slice(list, func(i, j int) bool {
			a, b := list[i], list[j]
			if a.Host != b.Host {
				return a.Host < b.Host
			}
			if a.PID != b.PID {
				return a.PID < b.PID
			}
			return a.ID < b.ID
		})
		p.f("\nLIVE ORCHESTRATOR\tCONSUMER\tID\tSTARTED\tLAST HEARTBEAT\n")
		for _, o := range list {
			p.f("%s:%d\t%s\t%s\t%s\t%s\n", o.Host, o.PID, o.Consumer, o.ID, fmtTime(o.StartedAt), fmtTime(o.SeenAt))
		}
	}
	return p.flush(tw)
}
