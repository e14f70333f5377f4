package console

import (
	"net/http"

	"github.com/onceflow/onceflow/saga"
)

// versionsPage is the definition versions still alive (saga.Admin.Versions).
type versionsPage struct {
	Versions []saga.VersionStatus
}

// versions lists the saga definition versions that have sagas not finished or that a live
// orchestrator registered, as `onceflow saga versions` does.
func (c *Console) versions(w http.ResponseWriter, r *http.Request) error {
	vs, err := c.sagas.Versions(r.Context(), c.cfg.DB)
	if err != nil {
		return err
	}
	c.render(w, r, http.StatusOK, "versions", versionsPage{Versions: vs})
	return nil
}
