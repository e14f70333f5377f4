package console

import (
	"errors"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/audit"
	"github.com/onceflow/onceflow/relay"
	"github.com/onceflow/onceflow/saga"
	"github.com/onceflow/onceflow/status"
)

// maxParam bounds every text a filter or id takes: enough for any topic, key or saga id,
// small enough that a request cannot make the database compare megabytes.
const maxParam = 512

// param returns the query parameter name, refusing text no id or filter can hold.
func param(r *http.Request, name string) (string, error) {
	v := strings.TrimSpace(r.URL.Query().Get(name))
	return v, checkText(name, v)
}

func checkText(name, v string) error {
	if len(v) > maxParam {
		return badInput("%s is %d bytes long; at most %d", name, len(v), maxParam)
	}
	if !utf8.ValidString(v) || strings.ContainsFunc(v, unicode.IsControl) {
		return badInput("%s contains control characters or invalid UTF-8", name)
	}
	return nil
}

// params reads several query parameters, reporting the first bad one.
func params(r *http.Request, names ...string) (map[string]string, error) {
	out := map[string]string{}
	for _, n := range names {
		v, err := param(r, n)
		if err != nil {
			return nil, err
		}
		out[n] = v
	}
	return out, nil
}

func (c *Console) overview(w http.ResponseWriter, r *http.Request) error {
	st, err := status.Read(r.Context(), c.cfg.DB, c.cfg.Schema, c.cfg.Thresholds)
	if err != nil {
		return err
	}
	c.render(w, r, http.StatusOK, "overview", st)
	return nil
}

// sagaFilterNames are the saga list's query parameters (and the bulk actions' filter).
var sagaFilterNames = []string{"name", "version", "state", "step", "error", "id", "older", "after", "limit"}

// sagaFilter reads the saga list's filter from the query: every problem is a 400.
func sagaFilter(r *http.Request) (saga.ListFilter, map[string]string, error) {
	return sagaFilterFrom(r.URL.Query().Get)
}

// sagaFilterFrom reads the saga list's filter from a query or a posted form.
func sagaFilterFrom(get func(string) string) (saga.ListFilter, map[string]string, error) {
	p := map[string]string{}
	for _, n := range sagaFilterNames {
		v := strings.TrimSpace(get(n))
		if err := checkText(n, v); err != nil {
			return saga.ListFilter{}, nil, err
		}
		p[n] = v
	}
	f := saga.ListFilter{Name: p["name"], State: saga.State(p["state"]), Step: p["step"], Error: p["error"], IDPrefix: p["id"], After: p["after"]}
	if v := p["version"]; v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			return f, p, badInput("version %q is not a definition version (1, 2, ...)", v)
		}
		f.Version = n
	}
	if v := p["older"]; v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return f, p, badInput("older %q is not a positive duration such as 30m or 2h", v)
		}
		f.StartedBefore = time.Now().Add(-d)
	}
	if v := p["limit"]; v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > saga.MaxListLimit {
			return f, p, badInput("limit %q is not a number between 1 and %d", v, saga.MaxListLimit)
		}
		f.Limit = n
	}
	return f, p, nil
}

type sagaListPage struct {
	F      map[string]string
	States []saga.State
	Page   saga.Page
	Next   string // URL of the next page, "" on the last
	// BulkRetry and BulkCompensate link to the bulk actions over the filter ("" when no
	// filter is set: a bulk action never applies to every saga).
	BulkRetry, BulkCompensate string
}

func (c *Console) sagaList(w http.ResponseWriter, r *http.Request) error {
	f, p, err := sagaFilter(r)
	if err != nil {
		return err
	}
	page, err := c.sagas.ListPage(r.Context(), c.cfg.DB, f)
	if err != nil {
		return err
	}
	v := sagaListPage{F: p, Page: page,
		States: []saga.State{saga.StateRunning, saga.StateCompensating, saga.StateStuck, saga.StateCompleted, saga.StateCompensated}}
	q := url.Values{}
	for _, n := range sagaFilterNames {
		if p[n] != "" && n != "after" && n != "limit" {
			q.Set(n, p[n])
		}
	}
	if len(q) > 0 {
		v.BulkRetry, v.BulkCompensate = c.link("/bulk/sagas/retry")+"?"+q.Encode(), c.link("/bulk/sagas/compensate")+"?"+q.Encode()
	}
	if page.Next != "" {
		q.Set("after", page.Next)
		if p["limit"] != "" {
			q.Set("limit", p["limit"])
		}
		v.Next = c.link("/sagas") + "?" + q.Encode()
	}
	c.render(w, r, http.StatusOK, "sagas", v)
	return nil
}

// sagaID reads and checks the {id} of a saga URL.
func sagaID(r *http.Request) (string, error) {
	id := r.PathValue("id")
	if id == "" {
		return "", badInput("no saga id")
	}
	return id, checkText("the saga id", id)
}

// timelineEvent is one line of a saga's timeline.
type timelineEvent struct {
	At      time.Time
	Step    string
	What    string
	EventID string
	Topic   string
	Error   string
}

type sagaPageData struct {
	D         *saga.Detail
	TraceID   string
	Timeline  []timelineEvent
	Requested string // the request just filed, from the redirect after a POST
	CanRetry  bool
	CanComp   bool
	PastPivot bool // on or past its pivot: it can only go forward
	Barriers  []saga.Barrier
	Audit     []audit.Entry // operators' actions on the saga, newest first
}

func (c *Console) sagaPage(w http.ResponseWriter, r *http.Request) error {
	id, err := sagaID(r)
	if err != nil {
		return err
	}
	d, err := c.sagas.Get(r.Context(), c.cfg.DB, id)
	if err != nil {
		return err
	}
	v := sagaPageData{D: d, Timeline: timeline(d), CanRetry: d.State == saga.StateStuck, CanComp: d.State == saga.StateRunning}
	if v.Barriers, err = c.sagas.Barriers(r.Context(), c.cfg.DB, d); err != nil {
		return err
	}
	if past, _ := c.sagas.PastPivot(d); past {
		v.CanComp, v.PastPivot = false, true
	}
	if v.Audit, err = c.auditOf(r, d.ID, sagaAuditActions); err != nil {
		return err
	}
	// traceparent: version-traceid-spanid-flags.
	if parts := strings.Split(d.TraceParent, "-"); len(parts) == 4 {
		v.TraceID = parts[1]
	}
	switch r.URL.Query().Get("requested") { // a fixed set: nothing of the query is echoed
	case "retry":
		v.Requested = "Retry requested: a running orchestrator carries it out within its timer interval."
	case "compensate":
		v.Requested = "Compensation requested: a running orchestrator carries it out within its timer interval."
	}
	c.render(w, r, http.StatusOK, "saga", v)
	return nil
}

// timeline orders what the saga's history records: steps started and finished, every command
// sent and every reply applied, with their event ids.
func timeline(d *saga.Detail) []timelineEvent {
	var out []timelineEvent
	for _, s := range d.Steps {
		kind := "remote"
		if s.Local {
			kind = "local"
		}
		if s.StartedAt != nil {
			out = append(out, timelineEvent{At: *s.StartedAt, Step: s.Name, What: "started (" + kind + " step)"})
		}
		for _, cmd := range s.Sent {
			out = append(out, timelineEvent{At: cmd.At, Step: s.Name, What: string(cmd.Phase) + " command, attempt " + strconv.Itoa(cmd.Attempt),
				EventID: cmd.EventID, Topic: cmd.Topic})
		}
		for _, r := range s.Replies {
			out = append(out, timelineEvent{At: r.At, Step: s.Name, What: string(r.Phase) + " reply, attempt " + strconv.Itoa(r.Attempt) + ": " + r.Outcome,
				Error: r.Reason, EventID: r.EventID})
		}
		if s.FinishedAt != nil {
			out = append(out, timelineEvent{At: *s.FinishedAt, Step: s.Name, What: "finished: " + s.Status, Error: s.LastError})
		}
	}
	slices.SortStableFunc(out, func(a, b timelineEvent) int { return a.At.Compare(b.At) })
	return out
}

// sagaActions are what the saga page's buttons ask for, and what the confirmation says.
var sagaActions = map[string]struct{ title, effect, state string }{
	"retry": {"Retry", "files a retry request for this stuck saga. A running orchestrator with the saga's definition " +
		"carries it out within its timer interval and resumes the saga. Fix the cause of the error first.", string(saga.StateStuck)},
	"compensate": {"Compensate", "files a compensation request for this running saga. A running orchestrator stops it and " +
		"compensates the steps that took effect, last first (the current step too: its compensation is a no-op if its action never ran). " +
		"A saga past its pivot can only go forward and is refused.", string(saga.StateRunning)},
}

type confirmData struct {
	Title   string
	Effect  string
	Refusal string // why the action does not apply; no button then
	Action  string // form target
	Back    string
	Hidden  map[string]string
	Count   int64
	IDs     []string
	More    bool // Count is capped: more match
	Takes   bool // the action takes only IDs, though more match
	// PostIDs are posted with the form (as "saga"; "id" is the filter's id prefix): the
	// action applies to these, and only while each still matches the filter.
	PostIDs []string
}

func (c *Console) sagaConfirm(w http.ResponseWriter, r *http.Request) error {
	id, err := sagaID(r)
	if err != nil {
		return err
	}
	act, ok := sagaActions[r.PathValue("action")]
	if !ok {
		return errNoPage
	}
	d, err := c.sagas.Get(r.Context(), c.cfg.DB, id)
	if err != nil {
		return err
	}
	back := c.link("/sagas/" + url.PathEscape(id))
	v := confirmData{Title: act.title + " saga " + id, Effect: act.title + " " + act.effect, Action: back + "/" + r.PathValue("action"), Back: back}
	if string(d.State) != act.state {
		v.Refusal = "The saga is " + string(d.State) + "; only a " + act.state + " saga can be asked to " + r.PathValue("action") + "."
	} else if past, _ := c.sagas.PastPivot(d); past && r.PathValue("action") == "compensate" {
		v.Refusal = "The saga is at step " + d.Step + ", on or past its pivot: it can only go forward, and the orchestrator would drop a compensation."
	}
	c.render(w, r, http.StatusOK, "confirm", v)
	return nil
}

func (c *Console) sagaAction(w http.ResponseWriter, r *http.Request) error {
	id, err := sagaID(r)
	if err != nil {
		return err
	}
	action := r.PathValue("action")
	if _, ok := sagaActions[action]; !ok {
		return errNoPage
	}
	err = pgx.BeginFunc(r.Context(), c.cfg.DB, func(tx pgx.Tx) error {
		if action == "retry" {
			return c.sagas.RetryTx(r.Context(), tx, id)
		}
		return c.sagas.CompensateTx(r.Context(), tx, id)
	})
	c.logAction(r, "saga "+action, err, "saga_id", id)
	if err != nil {
		return err
	}
	http.Redirect(w, r, c.link("/sagas/"+url.PathEscape(id))+"?requested="+action, http.StatusSeeOther)
	return nil
}

// bulkLimit is how many sagas one bulk action acts on; the page says when more match.
const bulkLimit = 100

// postedSagas are the saga ids a confirmation form posts (as "saga"): the ones its dry run
// listed, 1 to bulkLimit of them, each checked.
func postedSagas(r *http.Request) ([]string, error) {
	ids := r.PostForm["saga"]
	if len(ids) == 0 || len(ids) > bulkLimit {
		return nil, badInput("the form names %d sagas; an action takes the 1 to %d its dry run listed", len(ids), bulkLimit)
	}
	for _, id := range ids {
		if err := checkText("a saga id", id); err != nil {
			return nil, err
		}
	}
	return ids, nil
}

type bulkData struct {
	Title    string
	Action   string
	Result   saga.BulkResult
	Refusals []string
	Back     string
}

// bulkFilter reads a bulk action's filter; an empty filter is refused, so no click acts on
// every saga of the schema.
func bulkFilter(get func(string) string) (saga.ListFilter, map[string]string, error) {
	f, p, err := sagaFilterFrom(get)
	if err != nil {
		return f, p, err
	}
	f.After, f.Limit, p["after"], p["limit"] = "", 0, "", ""
	if f == (saga.ListFilter{}) {
		return f, p, badInput("a bulk action needs a filter (a state, a definition, ...): it never applies to every saga")
	}
	return f, p, nil
}

func (c *Console) bulkConfirm(w http.ResponseWriter, r *http.Request) error {
	action := r.PathValue("action")
	act, ok := sagaActions[action]
	if !ok {
		return errNoPage
	}
	f, p, err := bulkFilter(r.URL.Query().Get)
	if err != nil {
		return err
	}
	res, err := c.bulk(r, action, f, true, nil)
	if err != nil {
		return err
	}
	v := confirmData{Title: act.title + " the selected sagas", Action: c.link("/bulk/sagas/" + action), Back: c.link("/sagas") + "?" + r.URL.RawQuery,
		Effect: act.title + " " + act.effect + " It is filed for each saga listed here, in its own transaction, and only if the saga still matches the filter then: " +
			"one that moved on since, or started since, is left alone, and the result says which.",
		Hidden: p, Count: int64(len(res.Matched)), IDs: res.Matched, More: res.More, Takes: res.More, PostIDs: res.Matched}
	if len(res.Matched) == 0 {
		v.Refusal = "No saga matches this filter: there is nothing to " + action + "."
	}
	c.render(w, r, http.StatusOK, "confirm", v)
	return nil
}

func (c *Console) bulkAction(w http.ResponseWriter, r *http.Request) error {
	action := r.PathValue("action")
	act, ok := sagaActions[action]
	if !ok {
		return errNoPage
	}
	f, p, err := bulkFilter(r.PostForm.Get)
	if err != nil {
		return err
	}
	ids, err := postedSagas(r)
	if err != nil {
		return err
	}
	res, err := c.bulk(r, action, f, false, ids)
	c.logAction(r, "saga bulk "+action, err, "filter", p, "requested", len(res.Requested), "refused", len(res.Refused), "saga_ids", res.Requested)
	if err != nil && len(res.Requested) == 0 {
		return err
	}
	v := bulkData{Title: act.title + ": requested for " + strconv.Itoa(len(res.Requested)) + " of the " + strconv.Itoa(len(res.Matched)) +
		" sagas shown, " + strconv.Itoa(len(res.Refused)) + " skipped",
		Action: action, Result: res, Back: c.link("/sagas") + query("state", p["state"], "name", p["name"])}
	v.Refusals = refusals(res.Refused)
	if err != nil {
		v.Refusals = append(v.Refusals, "stopped: the database failed; the service's log has the error")
	}
	c.render(w, r, http.StatusOK, "bulk", v)
	return nil
}

func (c *Console) bulk(r *http.Request, action string, f saga.ListFilter, dry bool, ids []string) (saga.BulkResult, error) {
	o := saga.BulkOptions{DryRun: dry, Limit: bulkLimit, IDs: ids}
	if action == "retry" {
		return c.sagas.RetryMatching(r.Context(), c.cfg.DB, f, o)
	}
	return c.sagas.CompensateMatching(r.Context(), c.cfg.DB, f, o)
}

// logAction writes the action log line: who (the authenticated name), what, on what, and how
// it ended.
func (c *Console) logAction(r *http.Request, what string, err error, args ...any) {
	args = append([]any{"user", userOf(r), "action", what, "schema", c.cfg.Schema, "remote", r.RemoteAddr}, args...)
	if err != nil {
		c.cfg.Logger.Warn("console: action refused or failed", append(args, "err", err)...)
		return
	}
	c.cfg.Logger.Info("console: action", args...)
}

// pendingSample is how many of the oldest waiting rows the outbox page groups by key.
const pendingSample = 10_000

type outboxData struct {
	Backlog   relay.Backlog
	Keys      []relay.KeyBacklog
	Sample    int
	Topic     string
	Key       string
	Rows      []relay.Row
	CheckedAt time.Time
	Scheduled scheduledData
}

// scheduledData is the outbox page's section on scheduled messages: the figures, the topics of
// the next relay.ScheduledSample due, and one page of them in due order (filtered by topic).
type scheduledData struct {
	relay.ScheduledSummary
	Topics      []relay.ScheduledTopicCount
	Sample      int
	Topic       string // the scheduled_topic filter
	Page        relay.ScheduledPage
	Next        string  // the link to the following page; "" when none
	OverdueSecs float64 // how long the first due message is past its time
	GraceSecs   float64 // relay.ScheduledOverdueAfter: later than this past its time is overdue
}

// scheduledPage is how many scheduled messages the outbox page lists at a time.
const scheduledPage = 50

func (c *Console) outboxPage(w http.ResponseWriter, r *http.Request) error {
	p, err := params(r, "topic", "key", "scheduled_topic", "scheduled_after")
	if err != nil {
		return err
	}
	ctx := r.Context()
	b, err := c.relay.Backlog(ctx, c.cfg.DB)
	if err != nil {
		return err
	}
	v := outboxData{Backlog: b, Sample: pendingSample, Topic: p["topic"], Key: p["key"], CheckedAt: b.CheckedAt}
	if v.Keys, err = c.relay.PendingByKey(ctx, c.cfg.DB, pendingSample, 200); err != nil {
		return err
	}
	if v.Topic != "" || v.Key != "" {
		if v.Rows, err = c.relay.Pending(ctx, c.cfg.DB, relay.PendingFilter{Topic: v.Topic, Key: v.Key, Limit: 100}); err != nil {
			return err
		}
	}
	if v.Scheduled, err = c.scheduled(r, p["scheduled_topic"], p["scheduled_after"]); err != nil {
		return err
	}
	c.render(w, r, http.StatusOK, "outbox", v)
	return nil
}

// scheduled reads the outbox page's scheduled section: every read bounded by the due index
// (see relay.Admin.ScheduledSummary), at the same cost with a million rows scheduled.
func (c *Console) scheduled(r *http.Request, topic, after string) (scheduledData, error) {
	ctx := r.Context()
	v := scheduledData{Sample: relay.ScheduledSample, Topic: topic, GraceSecs: relay.ScheduledOverdueAfter.Seconds()}
	var err error
	if v.ScheduledSummary, err = c.relay.ScheduledSummary(ctx, c.cfg.DB); err != nil {
		return v, err
	}
	v.OverdueSecs = v.Lag().Seconds()
	if v.Rows == 0 && after == "" {
		return v, nil
	}
	if v.Topics, err = c.relay.ScheduledPerTopic(ctx, c.cfg.DB, relay.ScheduledSample); err != nil {
		return v, err
	}
	v.Page, err = c.relay.Scheduled(ctx, c.cfg.DB, relay.ScheduledFilter{Topic: topic, After: after, Limit: scheduledPage})
	if errors.Is(err, relay.ErrBadScheduledCursor) {
		return v, badInput("scheduled_after %q is not a cursor of this page's listing", after)
	}
	if err != nil {
		return v, err
	}
	if v.Page.Next != "" {
		v.Next = c.link("/outbox") + query("scheduled_topic", topic, "scheduled_after", v.Page.Next) + "#scheduled"
	}
	return v, nil
}

type findData struct {
	EventID   string
	Searched  bool
	Where     string // pending, parked, scheduled or "" (published, cancelled, or never written)
	Row       relay.Row
	Parked    *relay.ParkedRow
	Scheduled *relay.ScheduledMessage
}

func (c *Console) outboxFind(w http.ResponseWriter, r *http.Request) error {
	id, err := param(r, "event_id")
	if err != nil {
		return err
	}
	v := findData{EventID: id}
	if id == "" {
		c.render(w, r, http.StatusOK, "find", v)
		return nil
	}
	if _, err := uuid.Parse(id); err != nil {
		return badInput("event id %q is not a UUID", id)
	}
	v.Searched = true
	// No index on outbox.event_id (it would cost every business commit): Find reads the
	// waiting rows once, as `onceflow outbox find` does.
	found, err := c.relay.Find(r.Context(), c.cfg.DB, id)
	if err != nil {
		return err
	}
	switch {
	case len(found.Pending) > 0:
		v.Where, v.Row = "pending", found.Pending[0].Row
	case len(found.Parked) > 0:
		v.Where, v.Parked = "parked", &found.Parked[0].ParkedRow
	case len(found.Scheduled) > 0:
		v.Where, v.Scheduled = "scheduled", &found.Scheduled[0]
	}
	c.render(w, r, http.StatusOK, "find", v)
	return nil
}

// parkedFilter reads a parked-row filter from a form or query: id (comma-separated),
// event_id, topic, key, all=1.
func parkedFilter(get func(string) string) (relay.ParkedFilter, map[string]string, error) {
	p := map[string]string{}
	for _, n := range []string{"id", "event_id", "topic", "key", "all"} {
		v := strings.TrimSpace(get(n))
		if err := checkText(n, v); err != nil {
			return relay.ParkedFilter{}, nil, err
		}
		p[n] = v
	}
	f := relay.ParkedFilter{Topic: p["topic"], Key: p["key"], All: p["all"] == "1"}
	for _, s := range strings.Split(p["id"], ",") {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n < 1 {
			return f, p, badInput("id %q is not a row id", s)
		}
		f.IDs = append(f.IDs, n)
	}
	for _, s := range strings.Split(p["event_id"], ",") {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		if _, err := uuid.Parse(s); err != nil {
			return f, p, badInput("event id %q is not a UUID", s)
		}
		f.EventIDs = append(f.EventIDs, s)
	}
	return f, p, nil
}

type parkedData struct {
	F        map[string]string
	Rows     []relay.ParkedRow
	Next     string
	Replayed string
}

func (c *Console) outboxParked(w http.ResponseWriter, r *http.Request) error {
	f, p, err := parkedFilter(r.URL.Query().Get)
	if err != nil {
		return err
	}
	if a := r.URL.Query().Get("after"); a != "" {
		n, err := strconv.ParseInt(a, 10, 64)
		if err != nil || n < 0 {
			return badInput("after %q is not a row id", a)
		}
		f.AfterID = n
	}
	f.Limit = 100
	rows, err := c.relay.Parked(r.Context(), c.cfg.DB, f)
	if err != nil {
		return err
	}
	v := parkedData{F: p, Rows: rows}
	if len(rows) == f.Limit {
		v.Next = c.link("/outbox/parked") + query("topic", p["topic"], "key", p["key"], "after", strconv.FormatInt(rows[len(rows)-1].ID, 10))
	}
	if n, err := strconv.Atoi(r.URL.Query().Get("replayed")); err == nil && n > 0 {
		v.Replayed = strconv.Itoa(n) + " parked rows moved back into the outbox; the relays publish them with their original event ids."
	}
	c.render(w, r, http.StatusOK, "parked", v)
	return nil
}

// replayDryRunCap bounds the dry run's count: a replay larger than this is shown as "more".
const replayDryRunCap = 100_000

func (c *Console) outboxReplayConfirm(w http.ResponseWriter, r *http.Request) error {
	f, p, err := parkedFilter(r.URL.Query().Get)
	if err != nil {
		return err
	}
	n, first, err := c.relay.CountParked(r.Context(), c.cfg.DB, f, replayDryRunCap, 20)
	if errors.Is(err, relay.ErrEmptyReplayFilter) {
		return badInput("choose the parked rows to replay: an id, an event id, a topic, a key, or all")
	}
	if err != nil {
		return err
	}
	v := confirmData{Title: "Replay parked outbox rows", Action: c.link("/outbox/replay"), Back: c.link("/outbox/parked"),
		Effect: "Replay moves the selected parked rows back into the outbox with their original event ids, payloads and keys " +
			"and a fresh attempt count; the relays publish them after the rows already waiting.",
		Hidden: p, Count: n, More: n >= replayDryRunCap}
	for _, id := range first {
		v.IDs = append(v.IDs, strconv.FormatInt(id, 10))
	}
	if n == 0 {
		v.Refusal = "No parked row matches this filter: there is nothing to replay."
	}
	c.render(w, r, http.StatusOK, "confirm", v)
	return nil
}

func (c *Console) outboxReplay(w http.ResponseWriter, r *http.Request) error {
	f, p, err := parkedFilter(r.PostForm.Get)
	if err != nil {
		return err
	}
	if f.IDs == nil && f.EventIDs == nil && f.Topic == "" && f.Key == "" && !f.All {
		return badInput("choose the parked rows to replay: an id, an event id, a topic, a key, or all")
	}
	var moved []relay.Replayed
	err = pgx.BeginFunc(r.Context(), c.cfg.DB, func(tx pgx.Tx) error {
		var err error
		moved, err = c.relay.ReplayTx(r.Context(), tx, f)
		return err
	})
	if err == nil && len(moved) == 0 {
		err = badInput("no parked row matches this filter (replayed already?); nothing was moved")
	}
	c.logAction(r, "outbox replay", err, "filter", p, "moved", len(moved))
	if err != nil {
		return err
	}
	http.Redirect(w, r, c.link("/outbox/parked")+"?replayed="+strconv.Itoa(len(moved)), http.StatusSeeOther)
	return nil
}
