package console

import (
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/audit"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/inbox"
)

type inboxData struct {
	Consumer  string
	Rows      []inbox.PoisonRow
	Next      string
	Deleted   bool
	Replayed  string // how many replays the last action requested
	DeleteAll string // the bulk delete's confirmation for Consumer
	ReplayAll string // the bulk replay's confirmation (dry run first) for Consumer
	Released  string // how many parked messages the last action made due now
	Lane      laneData
}

// poisonPageSize is one page of the poison list, newest first, keyset-paginated on id.
const poisonPageSize = 100

func (c *Console) inboxPage(w http.ResponseWriter, r *http.Request) error {
	consumer, err := param(r, "consumer")
	if err != nil {
		return err
	}
	parkedAfter, err := param(r, "parked_after")
	if err != nil {
		return err
	}
	var before int64 // 0: from the newest row
	if b := r.URL.Query().Get("before"); b != "" {
		if before, err = strconv.ParseInt(b, 10, 64); err != nil || before < 1 {
			return badInput("before %q is not a row id", b)
		}
	}
	list, err := c.inbox.Poison(r.Context(), c.cfg.DB, inbox.PoisonFilter{Consumer: consumer, Before: before, Limit: poisonPageSize})
	if err != nil {
		return err
	}
	v := inboxData{Consumer: consumer, Rows: list, Deleted: r.URL.Query().Get("deleted") == "1", Replayed: r.URL.Query().Get("replayed"),
		DeleteAll: c.link("/inbox/delete") + query("consumer", consumer), ReplayAll: c.link("/inbox/replay") + query("consumer", consumer)}
	if _, err := strconv.Atoi(v.Replayed); err != nil {
		v.Replayed = ""
	}
	if v.Released = r.URL.Query().Get("released"); v.Released != "" {
		if _, err := strconv.Atoi(v.Released); err != nil {
			v.Released = ""
		}
	}
	if v.Lane, err = c.retryLane(r, consumer, parkedAfter); err != nil {
		return err
	}
	if len(list) == poisonPageSize {
		v.Next = c.link("/inbox") + query("consumer", consumer, "before", strconv.FormatInt(list[len(list)-1].ID, 10))
	}
	c.render(w, r, http.StatusOK, "inbox", v)
	return nil
}

// poisonID reads the {id} of a poison row's URL.
func poisonID(r *http.Request) (int64, error) {
	s := r.PathValue("id")
	id, err := strconv.ParseInt(s, 10, 64)
	if err != nil || id < 1 {
		return 0, badInput("%q is not a poison row id", shorten(40, s))
	}
	return id, nil
}

// poisonOfPath reads the poison row the request's path names.
func (c *Console) poisonOfPath(r *http.Request) (id int64, p *inbox.PoisonRow, err error) {
	if id, err = poisonID(r); err != nil {
		return 0, nil, err
	}
	p, err = c.inbox.PoisonByID(r.Context(), c.cfg.DB, id)
	if errors.Is(err, inbox.ErrNoPoisonRow) {
		return 0, nil, pageErr(http.StatusNotFound, "There is no poison row "+strconv.FormatInt(id, 10)+" (deleted already?).")
	}
	return id, p, err
}

func (c *Console) poisonPage(w http.ResponseWriter, r *http.Request) error {
	id, p, err := c.poisonOfPath(r)
	if err != nil {
		return err
	}
	es, err := c.auditOf(r, strconv.FormatInt(id, 10), poisonAuditActions)
	if err != nil {
		return err
	}
	c.render(w, r, http.StatusOK, "poison", poisonData{PoisonRow: p, Requested: r.URL.Query().Get("replayed") == "1", Audit: es})
	return nil
}

// poisonData is a poison row's page.
type poisonData struct {
	*inbox.PoisonRow
	Requested bool          // a replay was just requested
	Audit     []audit.Entry // operators' actions on the row, newest first
}

func (c *Console) poisonDeleteConfirm(w http.ResponseWriter, r *http.Request) error {
	id, p, err := c.poisonOfPath(r)
	if err != nil {
		return err
	}
	back := c.link("/inbox/" + strconv.FormatInt(id, 10))
	c.render(w, r, http.StatusOK, "confirm", confirmData{
		Title: "Delete poison row " + strconv.FormatInt(id, 10) + " of consumer " + p.Consumer,
		Effect: "Delete removes the row from inbox_poison once the message is handled. Its dedup row stays, " +
			"so a redelivery of the message is still skipped; nothing is re-applied.",
		Action: back + "/delete", Back: back, Hidden: map[string]string{"consumer": p.Consumer}})
	return nil
}

func (c *Console) poisonDelete(w http.ResponseWriter, r *http.Request) error {
	id, err := poisonID(r)
	if err != nil {
		return err
	}
	consumer := r.PostForm.Get("consumer") // the list to go back to
	err = pgx.BeginFunc(r.Context(), c.cfg.DB, func(tx pgx.Tx) error {
		// The consumer too: the row the operator confirmed, not another one under its id.
		deleted, err := c.inbox.DeletePoisonTx(r.Context(), tx, inbox.DeleteFilter{IDs: []int64{id}, Consumer: consumer})
		if err == nil && len(deleted) == 0 {
			err = badInput("there is no poison row %d (deleted already?); nothing was deleted", id)
		}
		return err
	})
	c.logAction(r, "inbox poison delete", err, "poison_id", id)
	if err != nil {
		return err
	}
	http.Redirect(w, r, c.link("/inbox")+query("consumer", consumer, "deleted", "1"), http.StatusSeeOther)
	return nil
}

// poisonFilter reads a bulk delete's filter: a consumer (required: a click never deletes every
// consumer's rows) and, optionally, text the error contains.
func poisonFilter(get func(string) string) (consumer, errText string, err error) {
	consumer, errText = strings.TrimSpace(get("consumer")), strings.TrimSpace(get("error"))
	if err := checkText("consumer", consumer); err != nil {
		return "", "", err
	}
	if err := checkText("error", errText); err != nil {
		return "", "", err
	}
	if consumer == "" {
		return "", "", badInput("choose the consumer whose poison rows to delete")
	}
	return consumer, errText, nil
}

func (c *Console) poisonBulkConfirm(w http.ResponseWriter, r *http.Request) error {
	consumer, errText, err := poisonFilter(r.URL.Query().Get)
	if err != nil {
		return err
	}
	// The rows the delete below takes, counted as it selects them; a larger cleanup is
	// several clicks, each logged.
	n, first, err := c.inbox.CountPoison(r.Context(), c.cfg.DB, consumer, errText, inbox.MaxDeleteLimit)
	if err != nil {
		return err
	}
	v := confirmData{Title: "Delete poison rows of consumer " + consumer, Action: c.link("/inbox/delete"), Back: c.link("/inbox") + query("consumer", consumer),
		Effect: "Delete removes the selected rows from inbox_poison once their messages are handled. Their dedup rows stay, " +
			"so redeliveries are still skipped; nothing is re-applied.",
		Hidden: map[string]string{"consumer": consumer, "error": errText}, Count: n, More: n >= inbox.MaxDeleteLimit, Takes: n >= inbox.MaxDeleteLimit}
	for _, id := range first {
		v.IDs = append(v.IDs, strconv.FormatInt(id, 10))
	}
	if n == 0 {
		v.Refusal = "No poison row matches: there is nothing to delete."
	}
	c.render(w, r, http.StatusOK, "confirm", v)
	return nil
}

func (c *Console) poisonBulkDelete(w http.ResponseWriter, r *http.Request) error {
	consumer, errText, err := poisonFilter(r.PostForm.Get)
	if err != nil {
		return err
	}
	var n int
	err = pgx.BeginFunc(r.Context(), c.cfg.DB, func(tx pgx.Tx) error {
		deleted, err := c.inbox.DeletePoisonTx(r.Context(), tx, inbox.DeleteFilter{Consumer: consumer, ErrorContains: errText, Limit: inbox.MaxDeleteLimit})
		n = len(deleted)
		if err == nil && n == 0 {
			err = badInput("no poison row of consumer %q matches; nothing was deleted", consumer)
		}
		return err
	})
	c.logAction(r, "inbox poison delete", err, "consumer", consumer, "error_contains", errText, "deleted", n)
	if err != nil {
		return err
	}
	http.Redirect(w, r, c.link("/inbox")+query("consumer", consumer, "deleted", "1"), http.StatusSeeOther)
	return nil
}

// Replay (inbox.Admin.ReplayTx): the console files the request, in one transaction with the row's
// state change; a running process of the row's consumer applies it exactly once. The
// confirmation pages run the same call as a dry run, so they show what the button will do:
// the count and ids, or why the replay is refused.

const replayEffect = "Replay re-drives the message through its own consumer, exactly once, with its original id, payload and metadata: " +
	"a running process of that consumer removes its dedup row, runs its handler and marks the row replayed, in one transaction, " +
	"within its replay interval (5 s by default). No other consumer group of the topic sees it again. " +
	"If it fails again it is given up again (state poison, with its attempts and history). Deploy the fix first."

// replayError maps ReplayTx's refusals (no such row, a refused row) to the request's own
// error, shown whole; anything else is the database's.
func replayError(err error) error {
	if errors.Is(err, inbox.ErrNoPoisonRow) || errors.Is(err, inbox.ErrReplayRefused) {
		return badInput("%v", err)
	}
	return err
}

func (c *Console) dryRunReplay(r *http.Request, f inbox.ReplayFilter) (inbox.ReplayResult, error) {
	f.DryRun = true
	var res inbox.ReplayResult
	err := pgx.BeginFunc(r.Context(), c.cfg.DB, func(tx pgx.Tx) error {
		var err error
		res, err = c.inbox.ReplayTx(r.Context(), tx, f)
		return err
	})
	return res, err
}

func (c *Console) poisonReplayConfirm(w http.ResponseWriter, r *http.Request) error {
	id, p, err := c.poisonOfPath(r)
	if err != nil {
		return err
	}
	back := c.link("/inbox/" + strconv.FormatInt(id, 10))
	v := confirmData{Title: "Replay poison message " + strconv.FormatInt(id, 10) + " of consumer " + p.Consumer,
		Effect: replayEffect, Action: back + "/replay", Back: back, Count: 1, IDs: []string{strconv.FormatInt(id, 10)}}
	if _, err := c.dryRunReplay(r, inbox.ReplayFilter{IDs: []int64{id}}); err != nil {
		msg, ok := inputText(replayError(err))
		if !ok {
			return err
		}
		v.Refusal, v.IDs = msg, nil
	}
	c.render(w, r, http.StatusOK, "confirm", v)
	return nil
}

func (c *Console) poisonReplay(w http.ResponseWriter, r *http.Request) error {
	id, err := poisonID(r)
	if err != nil {
		return err
	}
	res, err := c.requestReplay(r, inbox.ReplayFilter{IDs: []int64{id}})
	c.logAction(r, "inbox poison replay", err, "poison_id", id, "requested", len(res.Requested))
	if err != nil {
		return err
	}
	http.Redirect(w, r, c.link("/inbox/"+strconv.FormatInt(id, 10))+"?replayed=1", http.StatusSeeOther)
	return nil
}

// requestReplay files a replay request in its own transaction, by the console's user.
func (c *Console) requestReplay(r *http.Request, f inbox.ReplayFilter) (inbox.ReplayResult, error) {
	f.By = "console:" + userOf(r)
	var res inbox.ReplayResult
	err := pgx.BeginFunc(r.Context(), c.cfg.DB, func(tx pgx.Tx) error {
		var err error
		res, err = c.inbox.ReplayTx(r.Context(), tx, f)
		return err
	})
	return res, replayError(err)
}

// replayFilter reads a bulk replay's filter: a consumer (required: a click never replays every
// consumer's rows) and, optionally, text the error contains.
func replayFilter(get func(string) string) (inbox.ReplayFilter, map[string]string, error) {
	consumer, errText := strings.TrimSpace(get("consumer")), strings.TrimSpace(get("error"))
	for _, p := range []struct{ name, v string }{{"consumer", consumer}, {"error", errText}} {
		if err := checkText(p.name, p.v); err != nil {
			return inbox.ReplayFilter{}, nil, err
		}
	}
	if consumer == "" {
		return inbox.ReplayFilter{}, nil, badInput("choose the consumer whose poison rows to replay")
	}
	return inbox.ReplayFilter{Consumer: consumer, ErrorContains: errText, Limit: inbox.MaxReplayLimit},
		map[string]string{"consumer": consumer, "error": errText}, nil
}

func (c *Console) poisonBulkReplayConfirm(w http.ResponseWriter, r *http.Request) error {
	f, hidden, err := replayFilter(r.URL.Query().Get)
	if err != nil {
		return err
	}
	v := confirmData{Title: "Replay the poison rows of consumer " + f.Consumer, Effect: replayEffect,
		Action: c.link("/inbox/replay"), Back: c.link("/inbox") + query("consumer", f.Consumer), Hidden: hidden}
	res, err := c.dryRunReplay(r, f)
	if err != nil {
		msg, ok := inputText(replayError(err))
		if !ok {
			return err
		}
		v.Refusal = msg
	}
	v.Count, v.More, v.Takes = int64(len(res.Requested)), res.More, res.More
	for i, id := range res.Requested {
		if i == 20 {
			break
		}
		v.IDs = append(v.IDs, strconv.FormatInt(id, 10))
	}
	if len(res.Refused) > 0 && v.Refusal == "" {
		v.Effect += fmt.Sprintf(" %d matching rows are refused and stay as they are (a saga's message, or no dedup key; their pages say why).", len(res.Refused))
	}
	c.render(w, r, http.StatusOK, "confirm", v)
	return nil
}

func (c *Console) poisonBulkReplay(w http.ResponseWriter, r *http.Request) error {
	f, _, err := replayFilter(r.PostForm.Get)
	if err != nil {
		return err
	}
	res, err := c.requestReplay(r, f)
	c.logAction(r, "inbox poison replay", err, "consumer", f.Consumer, "error_contains", f.ErrorContains,
		"requested", len(res.Requested), "refused", len(res.Refused))
	if err != nil {
		return err
	}
	http.Redirect(w, r, c.link("/inbox")+query("consumer", f.Consumer, "replayed", strconv.Itoa(len(res.Requested))), http.StatusSeeOther)
	return nil
}

// idemRecord is one row of idempotency_record.
type idemRecord struct {
	Owner       string
	Key         string
	Fingerprint string
	Status      int
	Headers     map[string]string
	Body        []byte
	Stored      bool // false: the response exceeded the storage cap and was not kept
	CreatedAt   time.Time
	ExpiresAt   time.Time
}

// idemRecordOf is rec as the page shows it: the fingerprint in hex, each header's values on
// one line.
func idemRecordOf(rec idempotency.Record) idemRecord {
	shown := idemRecord{Owner: rec.Owner, Key: rec.Key, Fingerprint: hex.EncodeToString(rec.Fingerprint), Status: rec.Status,
		Headers: map[string]string{}, Body: rec.Body, Stored: rec.Stored, CreatedAt: rec.CreatedAt, ExpiresAt: rec.ExpiresAt}
	for k, vals := range rec.Headers {
		shown.Headers[k] = strings.Join(vals, ", ")
	}
	return shown
}

type idemData struct {
	Owner, Key string
	Searched   bool
	Record     *idemRecord
	Keys       []idemRecord
	Now        time.Time
}

// maxBodyShown bounds the stored response body rendered into the page.
const maxBodyShown = 64 << 10

func (c *Console) idempotencyPage(w http.ResponseWriter, r *http.Request) error {
	p, err := params(r, "owner", "key")
	if err != nil {
		return err
	}
	v := idemData{Owner: p["owner"], Key: p["key"], Now: time.Now()}
	if v.Key != "" && v.Owner == "" {
		return badInput("keys are scoped per owner: give the owner too")
	}
	if v.Owner == "" {
		c.render(w, r, http.StatusOK, "idempotency", v)
		return nil
	}
	v.Searched = true
	if v.Key != "" {
		rec, err := c.idem.Find(r.Context(), c.cfg.DB, v.Owner, v.Key, maxBodyShown)
		switch {
		case errors.Is(err, idempotency.ErrNoRecord):
		case err != nil:
			return err
		default:
			shown := idemRecordOf(*rec)
			v.Record = &shown
		}
	} else {
		// The owner's keys: a bounded range of the primary key (owner, idem_key).
		recs, err := c.idem.List(r.Context(), c.cfg.DB, v.Owner, "", 100)
		if err != nil {
			return err
		}
		for _, rec := range recs {
			v.Keys = append(v.Keys, idemRecordOf(rec))
		}
	}
	c.render(w, r, http.StatusOK, "idempotency", v)
	return nil
}
