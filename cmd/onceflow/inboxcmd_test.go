package main

import (
	"context"
	"encoding/json"
	"errors"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/status"
)

// Poison rows recorded by inbox.SettlePoison (what the batched consumer calls) are listed
// newest first, filtered by consumer, limited, as JSON with payload and dedup key; delete
// removes handled ones (and nothing on a bad id); status counts them.
func TestInboxPoisonCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	env := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema}

	r := runCmd(ctx, env, "inbox", "poison").expect(t, "inbox poison on an empty schema", 0)
	if !strings.Contains(r.stdout, "no poison messages") {
		t.Errorf("inbox poison on an empty schema:\n%s", r.stdout)
	}
	runCmd(ctx, env, "status").expect(t, "status without poison", 0)

	settle := func(consumer, source string, msg *message.Message, cause error) {
		t.Helper()
		ib, err := inbox.New(inbox.Config{Pool: db.Pool, Schema: db.Schema, Consumer: consumer})
		if err != nil {
			t.Fatal(err)
		}
		if err := ib.SettlePoison(ctx, msg, inbox.GiveUp{Source: source, Attempts: 5, Err: cause}); err != nil {
			t.Fatal(err)
		}
	}
	first := outbox.NewMessage([]byte(`{"order":"o-1"}`))
	first.Metadata.Set("k", "v")
	long := strings.Repeat("constraint invoice_amount_check failed; ", 10) + "THE END"
	settle("billing", "orders.placed/3@1234", first, errors.New(long))
	second := outbox.NewMessage([]byte{0xff, 0x00, 0x01}) // not UTF-8
	settle("billing", "orders.placed/1@7", second, errors.New("handler panicked:\nnil map"))
	third := outbox.NewMessage([]byte(`{}`))
	settle("audit", "orders.placed/0@1", third, errors.New("audit table missing"))

	r = runCmd(ctx, env, "inbox", "poison").expect(t, "inbox poison", 0)
	lines := strings.Split(r.stdout, "\n")
	// Newest first: audit's row, then billing's second, then its first.
	if len(lines) < 4 || !strings.HasPrefix(lines[0], "ID") || !strings.Contains(lines[1], third.UUID) ||
		!strings.Contains(lines[2], second.UUID) || !strings.Contains(lines[3], first.UUID) {
		t.Fatalf("inbox poison does not list the rows newest first:\n%s", r.stdout)
	}
	for _, want := range []string{"orders.placed/3@1234", "billing", "audit", "handler panicked: nil map", "3 poison messages",
		"onceflow inbox poison delete --id"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("inbox poison does not show %q:\n%s", want, r.stdout)
		}
	}
	if strings.Contains(r.stdout, "THE END") || !strings.Contains(r.stdout, "…") {
		t.Errorf("inbox poison shows the long error in full:\n%s", r.stdout)
	}

	r = runCmd(ctx, env, "inbox", "poison", "--consumer", "billing", "--limit", "1").expect(t, "inbox poison --consumer --limit", 0)
	if !strings.Contains(r.stdout, second.UUID) || strings.Contains(r.stdout, first.UUID) || strings.Contains(r.stdout, third.UUID) ||
		!strings.Contains(r.stdout, "2 poison messages (1 shown; --before ") {
		t.Errorf("inbox poison --consumer billing --limit 1:\n%s", r.stdout)
	}
	// The next page is the last one: it says so, and offers no page after it.
	next := regexp.MustCompile(`--before (\d+) lists`).FindStringSubmatch(r.stdout)
	if next == nil {
		t.Fatalf("no --before in:\n%s", r.stdout)
	}
	r = runCmd(ctx, env, "inbox", "poison", "--consumer", "billing", "--limit", "1", "--before", next[1]).expect(t, "inbox poison --before", 0)
	if !strings.Contains(r.stdout, first.UUID) || !strings.Contains(r.stdout, "2 poison messages (1 shown: the last page)") || strings.Contains(r.stdout, "lists the next page") {
		t.Errorf("the last page of inbox poison:\n%s", r.stdout)
	}
	r = runCmd(ctx, env, "inbox", "poison", "--consumer", "audit").expect(t, "inbox poison of one row", 0)
	if !strings.Contains(r.stdout, "\n1 poison message. ") {
		t.Errorf("one poison message:\n%s", r.stdout)
	}

	r = runCmd(ctx, env, "inbox", "poison", "list", "--json", "--consumer", "billing").expect(t, "inbox poison list --json", 0)
	var rows []poisonRow
	if err := json.Unmarshal([]byte(r.stdout), &rows); err != nil {
		t.Fatalf("inbox poison --json: %v\n%s", err, r.stdout)
	}
	if len(rows) != 2 || rows[1].MessageUUID != first.UUID || rows[1].Error != long || rows[1].Attempts != 5 ||
		rows[1].Payload == nil || *rows[1].Payload != `{"order":"o-1"}` || rows[1].Metadata["k"] != "v" ||
		rows[1].DedupKey == nil || *rows[1].DedupKey != "event:"+first.UUID || rows[1].Source != "orders.placed/3@1234" ||
		rows[0].Payload != nil || string(rows[0].PayloadBase64) != "\xff\x00\x01" || rows[0].FailedAt.IsZero() {
		t.Errorf("inbox poison --json:\n%s", r.stdout)
	}

	// status counts them per consumer, and is stuck above --max-inbox-poison.
	r = runCmd(ctx, env, "status").expect(t, "status with poison", exitStuck)
	if !strings.Contains(r.stdout, "3 inbox messages given up as poison") || !strings.Contains(r.stdout, "onceflow inbox poison") {
		t.Errorf("status with poison rows:\n%s", r.stdout)
	}
	r = runCmd(ctx, env, "status", "--json", "--max-inbox-poison", "3").expect(t, "status --max-inbox-poison 3", 0)
	var rep statusReport
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.InboxPoison) != 2 || rep.InboxPoison[0] != (status.Poison{Consumer: "audit", Count: 1}) || rep.InboxPoison[1] != (status.Poison{Consumer: "billing", Count: 2}) {
		t.Errorf("status --json inbox_poison: %+v", rep.InboxPoison)
	}

	id := func(uuid string) string {
		for _, r := range rows {
			if r.MessageUUID == uuid {
				return strconv.FormatInt(r.ID, 10)
			}
		}
		t.Fatalf("no row of %s", uuid)
		return ""
	}
	count := func() int {
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Table("inbox_poison")).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	// Bad input changes nothing: an unknown id, a row of another consumer, no id, not an id.
	r = runCmd(ctx, env, "inbox", "poison", "delete", "--id", id(first.UUID)+",999999").expect(t, "delete an unknown id", 1)
	if !strings.Contains(r.stderr, "999999") || !strings.Contains(r.stderr, "nothing deleted") || count() != 3 {
		t.Errorf("delete with an unknown id (%d rows left):\n%s", count(), r.stderr)
	}
	runCmd(ctx, env, "inbox", "poison", "delete", "--id", id(first.UUID), "--consumer", "audit").expect(t, "delete another consumer's row", 1)
	runCmd(ctx, env, "inbox", "poison", "delete").expect(t, "delete without --id", 2)
	runCmd(ctx, env, "inbox", "poison", "delete", "--id", "x").expect(t, "delete --id x", 1)
	if count() != 3 {
		t.Fatalf("%d rows after refused deletes, want 3", count())
	}

	r = runCmd(ctx, env, "inbox", "poison", "delete", "--id", id(first.UUID)+","+id(second.UUID), "--consumer", "billing").expect(t, "delete", 0)
	if !strings.Contains(r.stdout, "2 poison rows deleted") || count() != 1 {
		t.Errorf("delete (%d rows left):\n%s", count(), r.stdout)
	}
	// The audit trail has the deletion, by the OS user through the CLI; the refused ones
	// above left no record.
	var actor, action string
	var records int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) OVER (), actor, action FROM `+db.Table("operator_action")).Scan(&records, &actor, &action); err != nil {
		t.Fatal(err)
	}
	if records != 1 || !strings.HasPrefix(actor, "cli:") || len(actor) == len("cli:") || action != "inbox delete" {
		t.Errorf("audit trail after the CLI's delete: %d records, %q by %q", records, action, actor)
	}
	// The dedup rows stay: a redelivery is still skipped.
	var dedup int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Table("processed_event")+` WHERE dedup_key = $1`, "event:"+first.UUID).Scan(&dedup); err != nil {
		t.Fatal(err)
	}
	if dedup != 1 {
		t.Errorf("%d dedup rows of a deleted poison message, want 1", dedup)
	}
	runCmd(ctx, env, "inbox", "poison", "--limit", "0").expect(t, "inbox poison --limit 0", 1)
	runCmd(ctx, env, "inbox", "nope").expect(t, "inbox nope", 2)
	runCmd(ctx, env, "inbox").expect(t, "inbox", 2)
}
