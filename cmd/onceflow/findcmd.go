package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/relay"
)

// foundEvent is where `onceflow outbox find` found an event; --json prints it as is.
type foundEvent struct {
	EventID string `json:"event_id"`
	// Where is "pending" (in the outbox), "parked" (in outbox_parked), "scheduled" (in
	// outbox_scheduled, waiting for its due time), several joined by "+" ("pending+parked":
	// replayed copies, or written twice) or "gone": in none of them, so published (a row
	// leaves the outbox only once the broker acknowledged it), cancelled while scheduled, or
	// never committed.
	Where     string           `json:"where"`
	Pending   []foundRow       `json:"pending"`
	Parked    []foundRow       `json:"parked"`
	Scheduled []foundScheduled `json:"scheduled"`
	Inbox     *foundDedup      `json:"inbox,omitempty"`
	Note      string           `json:"note,omitempty"`
}

// foundScheduled is the event waiting in outbox_scheduled for its due time.
type foundScheduled struct {
	Topic     string            `json:"topic"`
	Key       string            `json:"key"`
	DueAt     time.Time         `json:"due_at"`
	CreatedAt time.Time         `json:"created_at"`
	Metadata  map[string]string `json:"metadata"`
}

type foundRow struct {
	ID        int64             `json:"id"`
	Topic     string            `json:"topic"`
	Key       string            `json:"key"`
	CreatedAt time.Time         `json:"created_at"`
	Attempts  int               `json:"attempts"`
	LastError string            `json:"last_error"`
	Shard     int               `json:"shard"`
	Owner     string            `json:"shard_owner"`      // relay holding the row's shard ("" = none)
	OwnerLive bool              `json:"shard_owner_live"` // its lease has not expired
	ParkedAt  *time.Time        `json:"parked_at,omitempty"`
	ParkedBy  string            `json:"parked_by,omitempty"`
	Metadata  map[string]string `json:"metadata"`
}

func newFoundRow(r relay.Row, l relay.ShardLease) foundRow {
	return foundRow{ID: r.ID, Topic: r.Topic, Key: r.Key, CreatedAt: r.CreatedAt, Attempts: r.Attempts, LastError: r.LastError,
		Shard: l.Shard, Owner: l.Owner, OwnerLive: l.OwnerLive, Metadata: r.Metadata}
}

// foundDedup is the inbox's dedup row of the event for one consumer.
type foundDedup struct {
	Consumer    string     `json:"consumer"`
	DedupKey    string     `json:"dedup_key"`
	Processed   bool       `json:"processed"`
	ProcessedAt *time.Time `json:"processed_at,omitempty"`
}

const findSynopsis = `outbox find EVENT_ID [flags]

Tells where an event is: pending in the outbox (with its attempts, last error and the relay
holding its shard), parked (with the error that parked it), scheduled for later (with its due
time), or gone, which means published (a row leaves the outbox only after the broker
acknowledged it) or, for a scheduled message, cancelled. With --consumer, also whether
that consumer's inbox processed it (its dedup row in processed_event). The outbox has no
index on event_id: on a large backlog the lookup reads the whole table once.`

func (c *cli) outboxFind(ctx context.Context, args []string) error {
	fs := c.newFlagSet("outbox find", findSynopsis)
	db := c.addDBFlags(fs)
	consumer := fs.String("consumer", "", "also show this inbox consumer's dedup row for the event")
	dedupKey := fs.String("dedup-key", "", "the dedup key to look up with --consumer (default: inbox.DefaultKey of the row's metadata, "+
		"else of the event id; saga messages are keyed by saga id, step, phase and attempt)")
	asJSON := fs.Bool("json", false, "print the result as JSON")
	// The event id may come before, between or after the flags.
	var id string
	var rest []string
	for {
		if err := parse(fs, args); err != nil {
			return err
		}
		if fs.NArg() == 0 {
			break
		}
		if id == "" {
			id = fs.Arg(0)
		} else {
			rest = append(rest, fs.Arg(0))
		}
		args = fs.Args()[1:]
	}
	if len(rest) > 0 {
		return fmt.Errorf("unexpected arguments %q: pass one event id", rest)
	}
	if id == "" {
		fmt.Fprintln(c.stderr, "onceflow outbox find: which event? pass its id (a UUID), e.g. onceflow outbox find 0193a5d2-7c4e-7b1a-9f00-1234567890ab")
		fs.Usage()
		return errUsage
	}
	u, err := uuid.Parse(id)
	if err != nil {
		return fmt.Errorf("%q is not an event id (a UUID)", id)
	}
	if *dedupKey != "" && *consumer == "" {
		return errors.New("--dedup-key needs --consumer")
	}
	pool, err := db.connectMigrated(ctx, "onceflow-outbox")
	if err != nil {
		return err
	}
	defer pool.Close()
	admin, err := relay.NewAdmin(db.schema)
	if err != nil {
		return err
	}
	found, err := admin.Find(ctx, pool, u.String())
	if err != nil {
		return err
	}
	f := &foundEvent{EventID: found.EventID, Where: found.Where(), Pending: []foundRow{}, Parked: []foundRow{}, Scheduled: []foundScheduled{}}
	for _, r := range found.Pending {
		f.Pending = append(f.Pending, newFoundRow(r.Row, r.ShardLease))
	}
	for _, r := range found.Parked {
		row := newFoundRow(r.Row, r.ShardLease)
		row.ParkedAt, row.ParkedBy = &r.ParkedAt, r.ParkedBy
		f.Parked = append(f.Parked, row)
	}
	for _, m := range found.Scheduled {
		f.Scheduled = append(f.Scheduled, foundScheduled{Topic: m.Topic, Key: m.Key, DueAt: m.DueAt, CreatedAt: m.CreatedAt, Metadata: m.Metadata})
	}
	if f.Where == "gone" {
		f.Note = "not in the outbox, parked nor scheduled: published (a row is deleted only after the broker acknowledged it), " +
			"cancelled while scheduled (outbox.CancelTx), or its transaction never committed"
	}
	if *consumer != "" {
		key := *dedupKey
		if key == "" {
			key = f.dedupKey()
		}
		d := &foundDedup{Consumer: *consumer, DedupKey: key}
		admin, err := inbox.NewAdmin(db.schema)
		if err != nil {
			return err
		}
		at, ok, err := admin.Processed(ctx, pool, *consumer, key)
		if err != nil {
			return err
		}
		if ok {
			d.Processed, d.ProcessedAt = true, &at
		}
		f.Inbox = d
	}
	if *asJSON {
		b, _ := json.Marshal(f)
		_, err := fmt.Fprintf(c.stdout, "%s\n", b)
		return err
	}
	return f.print(c)
}

// dedupKey is the inbox's default key of the event: from a row's metadata when one was
// found (saga messages are keyed by their saga reference), else the key of the event id.
func (f *foundEvent) dedupKey() string {
	var metas []map[string]string
	for _, r := range append(append([]foundRow{}, f.Pending...), f.Parked...) {
		metas = append(metas, r.Metadata)
	}
	for _, m := range f.Scheduled {
		metas = append(metas, m.Metadata)
	}
	for _, meta := range metas {
		msg := message.NewMessage(f.EventID, nil)
		for k, v := range meta {
			msg.Metadata.Set(k, v)
		}
		if k, err := inbox.DefaultKey(msg); err == nil {
			return k
		}
	}
	k, _ := inbox.DefaultKey(message.NewMessage(f.EventID, nil))
	return k
}

func (f *foundEvent) print(c *cli) error {
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	p := &printer{w: tw}
	p.f("event %s: %s\n", f.EventID, f.Where)
	if f.Note != "" {
		p.f("  %s\n", f.Note)
	}
	if len(f.Pending) > 0 {
		p.f("\nPENDING ID\tTOPIC\tKEY\tCREATED\tATTEMPTS\tSHARD\tSHARD OWNER\tLAST ERROR\n")
		for _, r := range f.Pending {
			p.f("%d\t%s\t%s\t%s\t%d\t%d\t%s\t%s\n", r.ID, r.Topic, r.Key, fmtTime(r.CreatedAt), r.Attempts, r.Shard, ownerText(r), oneLine(r.LastError))
		}
	}
	if len(f.Parked) > 0 {
		p.f("\nPARKED ID\tTOPIC\tKEY\tCREATED\tATTEMPTS\tPARKED\tBY\tERROR\n")
		for _, r := range f.Parked {
			at := time.Time{}
			if r.ParkedAt != nil {
				at = *r.ParkedAt
			}
			p.f("%d\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", r.ID, r.Topic, r.Key, fmtTime(r.CreatedAt), r.Attempts, fmtTime(at), r.ParkedBy, oneLine(r.LastError))
		}
		p.f("(replay with: onceflow outbox replay --event-id %s)\n", f.EventID)
	}
	if len(f.Scheduled) > 0 {
		p.f("\nSCHEDULED TOPIC\tKEY\tDUE\tWRITTEN\n")
		for _, m := range f.Scheduled {
			p.f("%s\t%s\t%s\t%s\n", m.Topic, m.Key, fmtTime(m.DueAt), fmtTime(m.CreatedAt))
		}
		p.f("(a relay moves it into the outbox at its due time and publishes it; outbox.CancelTx withdraws it until then)\n")
	}
	if d := f.Inbox; d != nil {
		if d.Processed {
			p.f("\ninbox: consumer %q processed it at %s (dedup key %q)\n", d.Consumer, fmtTime(*d.ProcessedAt), d.DedupKey)
		} else {
			p.f("\ninbox: consumer %q has no dedup row for key %q: not processed yet, or its row expired (retention)\n", d.Consumer, d.DedupKey)
		}
	}
	return p.flush(tw)
}

func ownerText(r foundRow) string {
	switch {
	case r.Owner == "":
		return "(none: no relay holds it)"
	case !r.OwnerLive:
		return r.Owner + " (lease expired)"
	default:
		return r.Owner
	}
}
