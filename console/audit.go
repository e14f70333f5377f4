package console

import (
	"net/http"
	"strconv"

	"github.com/onceflow/onceflow/audit"
)

// auditPage is the operators' audit trail (package audit), newest first.
type auditPage struct {
	Entries []audit.Entry
	Next    int64 // the Before of the next page; 0 when this is the last
}

// auditLimit is the page size of the audit trail, and how many records a saga's or a poison
// row's page shows.
const auditLimit = 100

func (c *Console) auditList(w http.ResponseWriter, r *http.Request) error {
	var before int64
	if b := r.URL.Query().Get("before"); b != "" {
		var err error
		if before, err = strconv.ParseInt(b, 10, 64); err != nil || before < 1 {
			return badInput("before %q is not a record id from this page", b)
		}
	}
	es, err := audit.List(r.Context(), c.cfg.DB, c.cfg.Schema, audit.Filter{Before: before, Limit: auditLimit + 1})
	if err != nil {
		return err
	}
	v := auditPage{Entries: es}
	if len(es) > auditLimit {
		v.Entries = es[:auditLimit]
		v.Next = v.Entries[auditLimit-1].ID
	}
	c.render(w, r, http.StatusOK, "audit", v)
	return nil
}

// The actions recorded on a saga, and on a poison row.
var (
	sagaAuditActions   = []string{audit.SagaRetry, audit.SagaCompensate, audit.SagaUpgrade}
	poisonAuditActions = []string{audit.InboxReplay, audit.InboxDelete}
)

// auditOf is the newest records of the actions on target (a saga id, a poison row id).
func (c *Console) auditOf(r *http.Request, target string, actions []string) ([]audit.Entry, error) {
	return audit.List(r.Context(), c.cfg.DB, c.cfg.Schema, audit.Filter{Target: target, Actions: actions, Limit: auditLimit})
}
