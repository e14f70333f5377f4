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

// The retry lane from the command line: inbox parked lists it key by key (head, then the rows
// behind), pages on with --after, filters, prints JSON; --count the figures per consumer;
// status reports a key waiting too long and a head no process applies; release makes heads
// due now (and refuses a row behind its head, changing nothing), recorded in the audit trail.
func TestInboxParkedCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	env := map[string]string{"DATABASE_URL": db.URL, "ONCEFLOW_SCHEMA": db.Schema}

	r := runCmd(ctx, env, "inbox", "parked").expect(t, "inbox parked on an empty schema", 0)
	if !strings.Contains(r.stdout, "no messages parked in a retry lane") {
		t.Errorf("inbox parked on an empty schema:\n%s", r.stdout)
	}
	r = runCmd(ctx, env, "status").expect(t, "status without a retry lane", 0)
	if !strings.Contains(r.stdout, "no inbox messages parked in a retry lane") {
		t.Errorf("status without a retry lane:\n%s", r.stdout)
	}

	park := func(consumer, lane, due, parked, errText string) int64 {
		t.Helper()
		var laneArg, dueArg *string
		if lane != "" {
			laneArg = &lane
		}
		if due != "" {
			dueArg = &due
		}
		var id int64
		if err := db.Pool.QueryRow(ctx, `INSERT INTO `+db.Table("inbox_parked")+` (consumer, topic, lane, dedup_key, message_uuid, source, payload, attempts, error, due_at, parked_at)
			VALUES ($1, 'orders', $2, gen_random_uuid()::text, gen_random_uuid()::text, 'orders/3@' || (random() * 1000)::int, 'x', ($5::text <> '')::int, $5,
				now() + $3::interval, now() - $4::interval) RETURNING id`, consumer, laneArg, dueArg, parked, errText).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	head := park("billing", "o-1", "10 minutes", "2 hours", "provider down:\n503")
	behind1 := park("billing", "o-1", "", "90 minutes", "")
	behind2 := park("billing", "o-1", "", "80 minutes", "")
	o2 := park("billing", "o-2", "5 minutes", "10 minutes", "provider down")
	alone := park("billing", "", "20 minutes", "1 minute", "rate limited")
	late := park("audit", "x", "-10 minutes", "15 minutes", "provider down")
	id := func(n int64) string { return strconv.FormatInt(n, 10) }

	r = runCmd(ctx, env, "inbox", "parked").expect(t, "inbox parked", 0)
	lines := strings.Split(r.stdout, "\n")
	var rowLines []string
	for _, l := range lines {
		if f := strings.Fields(l); len(f) > 0 && regexp.MustCompile(`^\d+$`).MatchString(f[0]) {
			rowLines = append(rowLines, l)
		}
	}
	want := []int64{late, head, behind1, behind2, o2, alone}
	if len(rowLines) != len(want) {
		t.Fatalf("inbox parked lists %d rows, want %d:\n%s", len(rowLines), len(want), r.stdout)
	}
	for i, w := range want {
		if strings.Fields(rowLines[i])[0] != id(w) {
			t.Errorf("row %d of the listing is %q, want id %d (lane order):\n%s", i, rowLines[i], w, r.stdout)
		}
	}
	for _, want := range []string{`consumer billing: 5 messages, 3 keys, longest wait 2h0m\ds \(key o-1 of topic orders\), next due in [45]m`,
		`consumer audit: 1 message, 1 key, longest wait 15m\ds \(key x of topic orders\), next due overdue 10m`,
		"head", "overdue 10m", "provider down: 503", "onceflow inbox parked release --id N"} {
		if !regexp.MustCompile(want).MatchString(r.stdout) {
			t.Errorf("inbox parked does not show %q:\n%s", want, r.stdout)
		}
	}
	if !regexp.MustCompile(`o-1 +behind +- `).MatchString(rowLines[2]) || !strings.Contains(rowLines[1], "head") || !regexp.MustCompile(`orders +- +head`).MatchString(rowLines[5]) {
		t.Errorf("head/behind/no key not shown:\n%s", r.stdout)
	}

	// Pages of 2 of billing's rows, on with the printed --after.
	var got []string
	args := []string{"inbox", "parked", "--consumer", "billing", "--limit", "2"}
	for page := 0; ; page++ {
		r = runCmd(ctx, env, args...).expect(t, "a page of inbox parked", 0)
		for _, l := range strings.Split(r.stdout, "\n") {
			if f := strings.Fields(l); len(f) > 0 && regexp.MustCompile(`^\d+$`).MatchString(f[0]) {
				got = append(got, f[0])
			}
		}
		next := regexp.MustCompile(`add --after (\S+) for the next page`).FindStringSubmatch(r.stdout)
		if next == nil || page > 5 {
			break
		}
		args = []string{"inbox", "parked", "--consumer", "billing", "--limit", "2", "--after", next[1]}
	}
	if strings.Join(got, ",") != strings.Join([]string{id(head), id(behind1), id(behind2), id(o2), id(alone)}, ",") {
		t.Errorf("billing's rows in pages of 2: %v", got)
	}

	r = runCmd(ctx, env, "inbox", "parked", "--json", "--consumer", "billing", "--topic", "orders", "--key", "o-1").expect(t, "inbox parked --json --key", 0)
	var page parkedJSON
	if err := json.Unmarshal([]byte(r.stdout), &page); err != nil {
		t.Fatalf("inbox parked --json: %v\n%s", err, r.stdout)
	}
	if len(page.Rows) != 3 || !page.Rows[0].Head || page.Rows[0].DueAt == nil || page.Rows[0].Error != "provider down:\n503" || page.Rows[0].Attempts != 1 ||
		page.Rows[1].Head || page.Rows[1].DueAt != nil || page.Rows[2].ID != behind2 || page.Rows[0].Key != "o-1" || page.Rows[0].DedupKey == "" ||
		page.Next != "" || page.CheckedAt.IsZero() {
		t.Errorf("inbox parked --json --key o-1:\n%s", r.stdout)
	}
	r = runCmd(ctx, env, "inbox", "parked", "--order", "id", "--json").expect(t, "inbox parked --order id", 0)
	if err := json.Unmarshal([]byte(r.stdout), &page); err != nil || len(page.Rows) != 6 || page.Rows[0].ID != head || page.Rows[5].ID != late {
		t.Errorf("inbox parked --order id --json (%v):\n%s", err, r.stdout)
	}

	r = runCmd(ctx, env, "inbox", "parked", "--count").expect(t, "inbox parked --count", 0)
	for _, want := range []string{"CONSUMER", "audit", "billing", "2h0m", "orders o-1", "overdue 10m"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("inbox parked --count does not show %q:\n%s", want, r.stdout)
		}
	}
	r = runCmd(ctx, env, "inbox", "parked", "--count", "--json").expect(t, "inbox parked --count --json", 0)
	var counts []parkedCountJSON
	if err := json.Unmarshal([]byte(r.stdout), &counts); err != nil || len(counts) != 2 || counts[1].Consumer != "billing" || counts[1].Rows != 5 ||
		counts[1].Keys != 3 || counts[1].OldestID != head || counts[1].OldestKey != "o-1" || counts[0].LagSeconds < 590 || counts[1].NextDue == nil {
		t.Errorf("inbox parked --count --json (%v):\n%s", err, r.stdout)
	}

	// Bad input says what to do.
	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"inbox", "parked", "--topic", "orders"}, 1, "--topic needs --consumer"},
		{[]string{"inbox", "parked", "--consumer", "billing", "--key", "o-1"}, 1, "--key needs --consumer and --topic"},
		{[]string{"inbox", "parked", "--count", "--consumer", "billing"}, 1, "--count counts every consumer's lane"},
		{[]string{"inbox", "parked", "--order", "due"}, 1, `--order is "due"; use lane or id`},
		{[]string{"inbox", "parked", "--after", "nonsense"}, 1, "is not a cursor a listing in --order lane printed"},
		{[]string{"inbox", "parked", "--limit", "0"}, 1, "--limit is 0"},
		{[]string{"inbox", "parked", "release"}, 2, "which heads?"},
		{[]string{"inbox", "parked", "release", "--id", "x"}, 1, `--id: not row ids: "x"`},
		{[]string{"inbox", "poison", "delete", "--id", "0,x"}, 1, `--id: not row ids: "0", "x"`},
		{[]string{"inbox", "poison", "replay", "--id", "7,-1"}, 1, `--id: not row ids: "-1"; nothing requested`},
		{[]string{"outbox", "parked", "--id", "1.5"}, 1, `--id: not row ids: "1.5"`},
		{[]string{"inbox", "parked", "release", "--id", id(head), "--limit", "5"}, 1, "--limit bounds a release by --consumer"},
	} {
		r := runCmd(ctx, env, c.args...).expect(t, strings.Join(c.args, " "), c.code)
		if !strings.Contains(r.stderr, c.want) {
			t.Errorf("%q: stderr does not say %q:\n%s", c.args, c.want, r.stderr)
		}
	}

	// status: billing's key o-1 has waited 2 h (over --max-lane-wait 1h), audit's head is 10
	// minutes overdue (over --max-lane-lag 5m).
	r = runCmd(ctx, env, "status").expect(t, "status with an old lane", exitStuck)
	for _, want := range []string{`key "o-1" (topic orders) of inbox consumer "billing" has waited 2h0m`, `in the retry lane (over 1h0m0s)`,
		`inbox consumer "audit"'s retry lane was due 10m`, "RETRY LANE", "orders o-1", "overdue 10m"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("status does not show %q:\n%s", want, r.stdout)
		}
	}
	r = runCmd(ctx, env, "status", "--json", "--max-lane-wait", "3h", "--max-lane-lag", "0").expect(t, "status with looser lane thresholds", 0)
	var rep statusReport
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.RetryLane) != 2 || rep.RetryLane[1].Consumer != "billing" || rep.RetryLane[1].Rows != 5 || rep.RetryLane[1].OldestKey != "o-1" {
		t.Errorf("status --json retry_lane: %+v", rep.RetryLane)
	}
	runCmd(ctx, env, "status", "--max-lane-wait", "-1s").expect(t, "status --max-lane-wait -1s", 1)

	// release: a row behind its head is refused, nothing changes; the head, then every head
	// of billing, are made due now.
	dueNow := func() int {
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Table("inbox_parked")+` WHERE due_at <= now()`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	r = runCmd(ctx, env, "inbox", "parked", "release", "--id", id(head)+","+id(behind1)).expect(t, "release a row behind", 1)
	if !strings.Contains(r.stderr, "row "+id(behind1)+" waits behind row "+id(head)) || !strings.Contains(r.stderr, "nothing released") || dueNow() != 1 {
		t.Errorf("release of a row behind (%d due):\n%s", dueNow(), r.stderr)
	}
	runCmd(ctx, env, "inbox", "parked", "release", "--id", id(head), "--consumer", "audit").expect(t, "release another consumer's row", 1)
	r = runCmd(ctx, env, "inbox", "parked", "release", "--id", id(head)).expect(t, "release the head", 0)
	if !strings.Contains(r.stdout, "released parked row "+id(head)) || dueNow() != 2 {
		t.Errorf("release the head (%d due):\n%s", dueNow(), r.stdout)
	}
	r = runCmd(ctx, env, "inbox", "parked", "release", "--consumer", "billing").expect(t, "release billing", 0)
	if !strings.Contains(r.stdout, "2 heads made due now") || dueNow() != 4 {
		t.Errorf("release billing (%d due):\n%s", dueNow(), r.stdout)
	}
	r = runCmd(ctx, env, "inbox", "parked", "release", "--consumer", "billing").expect(t, "release billing again", 0)
	if !strings.Contains(r.stdout, "nothing released") {
		t.Errorf("release billing again:\n%s", r.stdout)
	}
	var records int
	var actor string
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) OVER (), actor FROM `+db.Table("operator_action")+` WHERE action = 'inbox release' LIMIT 1`).Scan(&records, &actor); err != nil {
		t.Fatal(err)
	}
	if records != 2 || !strings.HasPrefix(actor, "cli:") {
		t.Errorf("audit trail: %d release records, by %q", records, actor)
	}
}
