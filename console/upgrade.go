package console

import (
	"context"
	"errors"
	"net/http"
	"strconv"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/saga"
)

// upgradeData is the upgrade page: the dry run (which sagas of a version are at a step
// boundary, with their mapping when the console has the definitions) or, after the post, the
// requests filed.
type upgradeData struct {
	Name     string
	From, To int
	Target   string // "version 2" or "the newest version that declares saga.Upgrade from 1"
	Known    bool   // the console has a definition declaring the upgrade: mappings are shown
	Result   saga.UpgradeResult
	Refusals []string // "id: why", for the sagas not requested
	Filed    bool     // the page reports a post
	Back     string
}

// upgradeTarget reads the page's definition name, version and optional target version.
func (c *Console) upgradeTarget(r *http.Request, get func(string) string) (upgradeData, error) {
	d := upgradeData{Name: r.PathValue("name"), Back: c.link("/versions")}
	if err := checkText("the definition name", d.Name); err != nil || d.Name == "" {
		return d, badInput("give a definition name in the address: /versions/NAME/VERSION/upgrade")
	}
	var err error
	if d.From, err = strconv.Atoi(r.PathValue("version")); err != nil || d.From < 1 {
		return d, badInput("the version %q is not a positive number", r.PathValue("version"))
	}
	if to := get("to"); to != "" {
		if d.To, err = strconv.Atoi(to); err != nil || d.To <= d.From {
			return d, badInput("the target version %q is not a number above %d; leave it out for the newest version that declares the upgrade", to, d.From)
		}
	}
	d.Target = "the newest version that declares saga.Upgrade from " + strconv.Itoa(d.From)
	if d.To != 0 {
		d.Target = "version " + strconv.Itoa(d.To)
	}
	return d, nil
}

// upgradeConfirm is the dry run of an upgrade of one definition version: each unfinished
// saga at a step boundary (with its step mapping and converted data when the console was
// given the definitions, console.Config.Sagas), and the others with the reason they are not
// upgradable now. Nothing is filed.
func (c *Console) upgradeConfirm(w http.ResponseWriter, r *http.Request) error {
	d, err := c.upgradeTarget(r, r.URL.Query().Get)
	if err != nil {
		return err
	}
	d.Result, err = c.sagas.RequestUpgradeMatching(r.Context(), c.cfg.DB, d.Name, d.From, d.To, saga.BulkOptions{DryRun: true, Limit: bulkLimit})
	if err != nil {
		return err
	}
	for _, u := range d.Result.Requested {
		d.Known = d.Known || u.NewStep != ""
	}
	d.Refusals = refusals(d.Result.Refused)
	c.render(w, r, http.StatusOK, "upgrade", d)
	return nil
}

// upgradeAction files an upgrade request for each saga the dry run showed at a boundary (the
// form's ids, never a fresh query: an operator acts on what was shown), each in its own
// transaction, after checking again that it is a saga of this definition and version at a
// boundary; the orchestrator that has the target version carries each out.
func (c *Console) upgradeAction(w http.ResponseWriter, r *http.Request) error {
	d, err := c.upgradeTarget(r, r.PostForm.Get)
	if err != nil {
		return err
	}
	ids, err := postedSagas(r)
	if err != nil {
		return err
	}
	d.Filed, d.Result.Matched = true, ids
	var failed error
	for _, id := range ids {
		err := c.requestUpgrade(r.Context(), d, id)
		switch {
		case err == nil:
			d.Result.Requested = append(d.Result.Requested, saga.SagaUpgrade{ID: id})
			continue
		case errors.Is(err, saga.ErrNotUpgradable), errors.Is(err, saga.ErrWrongState), errors.Is(err, saga.ErrNotFound):
			d.Result.Refused = append(d.Result.Refused, saga.BulkRefusal{ID: id, Err: err})
			continue
		}
		failed = err
		break
	}
	requested := make([]string, len(d.Result.Requested))
	for i, u := range d.Result.Requested {
		requested[i] = u.ID
	}
	c.logAction(r, "saga upgrade", failed, "name", d.Name, "from", d.From, "to", d.To, "saga_ids", requested, "refused", len(d.Result.Refused))
	if failed != nil && len(requested) == 0 {
		return failed
	}
	d.Refusals = refusals(d.Result.Refused)
	if failed != nil {
		d.Refusals = append(d.Refusals, "stopped: the database failed; the service's log has the error")
	}
	c.render(w, r, http.StatusOK, "upgrade", d)
	return nil
}

// requestUpgrade files the upgrade request of one saga the form named, refusing a saga of
// another definition (the form is the operator's, but its ids are checked, not trusted).
func (c *Console) requestUpgrade(ctx context.Context, d upgradeData, id string) error {
	s, err := c.sagas.Get(ctx, c.cfg.DB, id)
	if err != nil {
		return err
	}
	if s.Name != d.Name {
		return &saga.Refusal{ID: id, Kind: saga.ErrNotUpgradable, Reason: "it is a " + s.Name + " saga, not " + d.Name}
	}
	return pgx.BeginFunc(ctx, c.cfg.DB, func(tx pgx.Tx) error {
		return c.sagas.RequestUpgradeTx(ctx, tx, id, d.From, d.To)
	})
}

// refusals are "id: why" lines, without the prefixes the page already says.
func refusals(rs []saga.BulkRefusal) []string {
	out := make([]string, len(rs))
	for i, rf := range rs {
		out[i] = rf.ID + ": " + rf.Reason()
	}
	return out
}
