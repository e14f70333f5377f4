package console

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
)

// The inbox page's retry-lane section (inbox.RetryAfter): per consumer, what waits and for how
// long (inbox.Admin.ParkedSummary), and a page of the parked rows key by key
// (inbox.Admin.Parked), each an index range whatever the lane holds. With actions on, a head
// can be retried now, or every head of a consumer once its provider is back
// (inbox.Admin.ReleaseTx).

// lanePage is how many parked rows the inbox page lists at a time.
const lanePage = 50

// laneDueGrace is how long past its due time a head shows as due rather than overdue: a
// process of its consumer looks for due heads every second (inbox.Config.LaneInterval) and
// runs the handler.
const laneDueGrace = 5 * time.Second

// laneData is the inbox page's retry-lane section.
type laneData struct {
	Consumers []laneConsumer
	Rows      []laneRow
	Next      string // the link to the following page; "" when none
	Cap       int    // inbox.ParkedCountCap: counts stop there
}

// laneConsumer is one consumer's figures, as the page shows them.
type laneConsumer struct {
	inbox.ConsumerParked
	Rows, Keys string // "12", or "10000+" for a count that stopped at the cap
	Wait       string // how long the longest-waiting key has waited
	Next       string // when the next head is due: "in 4m", "now", "overdue 10m"
	Late       bool   // its next head is overdue
}

// laneRow is one parked row, as the page lists it.
type laneRow struct {
	inbox.ParkedRow
	Due  string // "in 9m59s", "now", "overdue 2m" or "waits behind its head"
	Late bool
}

// laneDue says when due is from now (the database's clock), and whether it is late.
func laneDue(due, now time.Time) (string, bool) {
	d := due.Sub(now)
	switch {
	case d > 0:
		return "in " + fmtDur(d), false
	case -d <= laneDueGrace:
		return "now", false
	default:
		return "overdue " + fmtDur(-d), true
	}
}

func cappedText(n int64, exact bool) string {
	if !exact {
		return strconv.Itoa(inbox.ParkedCountCap) + "+"
	}
	return strconv.FormatInt(n, 10)
}

// retryLane reads the section for consumer ("" = every consumer) from the cursor after.
func (c *Console) retryLane(r *http.Request, consumer, after string) (laneData, error) {
	ctx := r.Context()
	v := laneData{Cap: inbox.ParkedCountCap}
	sum, err := c.inbox.ParkedSummary(ctx, c.cfg.DB)
	if err != nil {
		return v, err
	}
	for _, s := range sum {
		lc := laneConsumer{ConsumerParked: s, Rows: cappedText(s.Rows, s.RowsExact), Keys: cappedText(s.Keys, s.KeysExact),
			Wait: fmtDur(s.OldestAge()), Next: "-"}
		if !s.NextDue.IsZero() {
			lc.Next, lc.Late = laneDue(s.NextDue, s.CheckedAt)
		}
		v.Consumers = append(v.Consumers, lc)
	}
	if len(sum) == 0 && after == "" {
		return v, nil
	}
	page, err := c.inbox.Parked(ctx, c.cfg.DB, inbox.ParkedFilter{Consumer: consumer, After: after, Limit: lanePage})
	if errors.Is(err, inbox.ErrBadParkedCursor) {
		return v, badInput("parked_after %q is not a cursor of this page's listing", after)
	}
	if err != nil {
		return v, err
	}
	for _, p := range page.Rows {
		row := laneRow{ParkedRow: p, Due: "waits behind its head"}
		if p.DueAt != nil {
			row.Due, row.Late = laneDue(*p.DueAt, page.CheckedAt)
		}
		v.Rows = append(v.Rows, row)
	}
	if page.Next != "" {
		v.Next = c.link("/inbox") + query("consumer", consumer, "parked_after", page.Next) + "#retry-lane"
	}
	return v, nil
}

const releaseEffect = "Retry now makes the message due at once: a running process of its consumer applies it within its lane interval " +
	"(1 s by default), exactly once, then the messages of its key parked behind it, in order. Its attempts stay counted: if its handler " +
	"asks for later again it is parked again (and given up as poison after the consumer's LaneMaxAttempts). Do it once the provider it waits for is back."

// errDryRun rolls a dry run's transaction back.
var errDryRun = errors.New("dry run")

// release runs ReleaseTx in a transaction of its own, committed, or rolled back for a dry run
// (a confirmation page shows what the button will do, or why it is refused).
func (c *Console) release(r *http.Request, f inbox.ReleaseFilter, dryRun bool) ([]int64, error) {
	var ids []int64
	err := pgx.BeginFunc(r.Context(), c.cfg.DB, func(tx pgx.Tx) error {
		var err error
		if ids, err = c.inbox.ReleaseTx(r.Context(), tx, f); err != nil {
			return err
		}
		if dryRun {
			return errDryRun
		}
		return nil
	})
	switch {
	case errors.Is(err, errDryRun):
		err = nil
	case errors.Is(err, inbox.ErrNoParkedRow) || errors.Is(err, inbox.ErrReleaseRefused):
		err = badInput("%v", err)
	}
	return ids, err
}

// parkedID reads the {id} of a parked row's URL.
func parkedID(r *http.Request) (int64, error) {
	s := r.PathValue("id")
	id, err := strconv.ParseInt(s, 10, 64)
	if err != nil || id < 1 {
		return 0, badInput("%q is not a parked row id", shorten(40, s))
	}
	return id, nil
}

func (c *Console) releaseConfirm(w http.ResponseWriter, r *http.Request) error {
	id, err := parkedID(r)
	if err != nil {
		return err
	}
	consumer, err := param(r, "consumer") // the list to go back to
	if err != nil {
		return err
	}
	back := c.link("/inbox") + query("consumer", consumer) + "#retry-lane"
	sid := strconv.FormatInt(id, 10)
	v := confirmData{Title: "Retry parked message " + sid + " now", Effect: releaseEffect,
		Action: c.link("/inbox/parked/" + sid + "/release"), Back: back, Hidden: map[string]string{"consumer": consumer}, Count: 1, IDs: []string{sid}}
	ids, err := c.release(r, inbox.ReleaseFilter{IDs: []int64{id}}, true)
	if msg, ok := inputText(err); ok {
		v.Refusal, v.IDs = msg, nil
	} else if err != nil {
		return err
	}
	if err == nil && len(ids) == 0 {
		v.Refusal, v.IDs = "Parked message "+sid+" is due already: a running process of its consumer applies it (if it stays overdue, none runs: the overview says so).", nil
	}
	c.render(w, r, http.StatusOK, "confirm", v)
	return nil
}

func (c *Console) releaseOne(w http.ResponseWriter, r *http.Request) error {
	id, err := parkedID(r)
	if err != nil {
		return err
	}
	consumer := strings.TrimSpace(r.PostForm.Get("consumer"))
	if err := checkText("consumer", consumer); err != nil {
		return err
	}
	ids, err := c.release(r, inbox.ReleaseFilter{IDs: []int64{id}}, false)
	c.logAction(r, "inbox parked release", err, "parked_id", id, "released", len(ids))
	if err != nil {
		return err
	}
	http.Redirect(w, r, c.link("/inbox")+query("consumer", consumer, "released", strconv.Itoa(len(ids)))+"#retry-lane", http.StatusSeeOther)
	return nil
}

// releaseConsumer reads a bulk release's consumer: required, a click never releases every
// consumer's heads.
func releaseConsumer(get func(string) string) (string, error) {
	consumer := strings.TrimSpace(get("consumer"))
	if err := checkText("consumer", consumer); err != nil {
		return "", err
	}
	if consumer == "" {
		return "", badInput("choose the consumer whose parked messages to retry now")
	}
	return consumer, nil
}

func (c *Console) releaseAllConfirm(w http.ResponseWriter, r *http.Request) error {
	consumer, err := releaseConsumer(r.URL.Query().Get)
	if err != nil {
		return err
	}
	v := confirmData{Title: "Retry the parked messages of consumer " + consumer + " now", Effect: releaseEffect + " Every head of the consumer's keys is released.",
		Action: c.link("/inbox/parked/release"), Back: c.link("/inbox") + query("consumer", consumer) + "#retry-lane", Hidden: map[string]string{"consumer": consumer}}
	ids, err := c.release(r, inbox.ReleaseFilter{Consumer: consumer}, true)
	if err != nil {
		return err
	}
	v.Count, v.More, v.Takes = int64(len(ids)), len(ids) >= inbox.MaxReleaseLimit, len(ids) >= inbox.MaxReleaseLimit
	for i, id := range ids {
		if i == 20 {
			break
		}
		v.IDs = append(v.IDs, strconv.FormatInt(id, 10))
	}
	if len(ids) == 0 {
		v.Refusal = fmt.Sprintf("Consumer %s has no parked message waiting for a later time: its heads are due already (or none is parked).", consumer)
	}
	c.render(w, r, http.StatusOK, "confirm", v)
	return nil
}

func (c *Console) releaseAll(w http.ResponseWriter, r *http.Request) error {
	consumer, err := releaseConsumer(r.PostForm.Get)
	if err != nil {
		return err
	}
	ids, err := c.release(r, inbox.ReleaseFilter{Consumer: consumer, Limit: inbox.MaxReleaseLimit}, false)
	c.logAction(r, "inbox parked release", err, "consumer", consumer, "released", len(ids))
	if err != nil {
		return err
	}
	http.Redirect(w, r, c.link("/inbox")+query("consumer", consumer, "released", strconv.Itoa(len(ids)))+"#retry-lane", http.StatusSeeOther)
	return nil
}
