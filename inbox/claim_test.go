package inbox_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
)

// ClaimTx records keys in one statement, reports which were new, and keeps nothing when the
// transaction rolls back.
func TestClaimTx(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	ctx := context.Background()

	claim := func(commit bool, keys ...string) []bool {
		t.Helper()
		tx, err := f.db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
		got, err := f.ib.ClaimTx(ctx, tx, keys...)
		if err != nil {
			t.Fatal(err)
		}
		if commit {
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
		}
		return got
	}

	if got := claim(false, "event:a", "event:b"); !slices.Equal(got, []bool{true, true}) {
		t.Fatalf("first claim = %v", got)
	}
	if n := f.dedupRows(); n != 0 {
		t.Fatalf("%d dedup rows after rollback, want 0", n)
	}
	if got := claim(true, "event:a"); !slices.Equal(got, []bool{true}) {
		t.Fatalf("claim after rollback = %v, want new", got)
	}
	// A repeated key in one call is new only at its first position; a, already committed, is not.
	if got := claim(true, "event:c", "event:a", "event:c", "event:b"); !slices.Equal(got, []bool{true, false, false, true}) {
		t.Fatalf("mixed claim = %v", got)
	}
	if got := claim(true, "event:a", "event:b", "event:c"); !slices.Equal(got, []bool{false, false, false}) {
		t.Fatalf("all duplicates = %v", got)
	}
	if n := f.dedupRows(); n != 3 {
		t.Fatalf("%d dedup rows, want 3", n)
	}
	if got := claim(true); got != nil {
		t.Fatalf("empty claim = %v", got)
	}
}

// Keys are checked before anything is recorded: one bad key refuses the whole call.
func TestClaimTxRefusesBadKeys(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	ctx := context.Background()
	for _, bad := range []string{"", "a\x00b", "\xff"} {
		err := pgx.BeginFunc(ctx, f.db.Pool, func(tx pgx.Tx) error {
			_, err := f.ib.ClaimTx(ctx, tx, "event:ok", bad)
			return err
		})
		if !errors.Is(err, inbox.ErrNoKey) {
			t.Errorf("key %q: err = %v, want ErrNoKey", bad, err)
		}
		if _, err := f.ib.SeenTx(ctx, nil, bad); !errors.Is(err, inbox.ErrNoKey) {
			t.Errorf("SeenTx(%q): err = %v, want ErrNoKey", bad, err)
		}
	}
	if n := f.dedupRows(); n != 0 {
		t.Fatalf("%d dedup rows, want 0", n)
	}
}

// SeenTx sees committed keys and keys claimed earlier in the same transaction, records
// nothing, and keeps consumers apart.
func TestSeenTx(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	other := f.newInbox(func(c *inbox.Config) { c.Consumer = "mailer" })
	ctx := context.Background()
	seen := func(ib *inbox.Inbox, tx pgx.Tx, key string) bool {
		t.Helper()
		ok, err := ib.SeenTx(ctx, tx, key)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	tx, err := f.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	if seen(f.ib, tx, "event:x") {
		t.Fatal("unknown key seen")
	}
	if f.dedupRows() != 0 {
		t.Fatal("SeenTx recorded the key")
	}
	if _, err := f.ib.ClaimTx(ctx, tx, "event:x"); err != nil {
		t.Fatal(err)
	}
	if !seen(f.ib, tx, "event:x") {
		t.Fatal("key claimed earlier in the transaction not seen")
	}
	if seen(other, tx, "event:x") {
		t.Fatal("another consumer's key seen")
	}
	// Not committed: invisible to other transactions.
	err = pgx.BeginFunc(ctx, f.db.Pool, func(tx2 pgx.Tx) error {
		if seen(f.ib, tx2, "event:x") {
			t.Error("uncommitted key seen by another transaction")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, f.db.Pool, func(tx2 pgx.Tx) error {
		if !seen(f.ib, tx2, "event:x") {
			t.Error("committed key not seen")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// Two transactions claiming overlapping keys concurrently: each key is new for exactly one of
// them, whoever commits first, and neither deadlocks (keys are locked in sorted order).
func TestClaimTxConcurrentOverlap(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	a := []string{"event:1", "event:2", "event:3", "event:4"}
	b := []string{"event:4", "event:3", "event:2", "event:5"} // reverse order on purpose
	for round := 0; round < 20; round++ {
		if _, err := f.db.Pool.Exec(ctx, `DELETE FROM `+f.db.Table("processed_event")); err != nil {
			t.Fatal(err)
		}
		results := make(chan map[string]bool, 2)
		errs := make(chan error, 2)
		for _, keys := range [][]string{a, b} {
			go func() {
				got := map[string]bool{}
				errs <- pgx.BeginFunc(ctx, f.db.Pool, func(tx pgx.Tx) error {
					claimed, err := f.ib.ClaimTx(ctx, tx, keys...)
					for i, k := range keys {
						if err == nil && claimed[i] {
							got[k] = true
						}
					}
					return err
				})
				results <- got
			}()
		}
		total := map[string]int{}
		for range 2 {
			if err := <-errs; err != nil {
				t.Fatalf("round %d: %v", round, err)
			}
			for k := range <-results {
				total[k]++
			}
		}
		for _, k := range []string{"event:1", "event:2", "event:3", "event:4", "event:5"} {
			if total[k] != 1 {
				t.Fatalf("round %d: key %s claimed %d times, want 1 (%v)", round, k, total[k], total)
			}
		}
	}
}

// An unmigrated schema: CheckSchema says so before the first message, and a message that
// reaches the middleware anyway fails with the same actionable error instead of a bare
// SQLSTATE.
func TestUnmigratedSchema(t *testing.T) {
	t.Parallel()
	db := testdb.NewEmpty(t)
	ib, err := inbox.New(inbox.Config{Pool: db.Pool, Schema: db.Schema, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	err = ib.CheckSchema(ctx)
	if !errors.Is(err, migrations.ErrNotMigrated) || !strings.Contains(err.Error(), "onceflow migrate up --schema "+db.Schema) {
		t.Fatalf("CheckSchema = %v, want ErrNotMigrated naming the command", err)
	}
	h := ib.Middleware(func(*message.Message) ([]*message.Message, error) {
		t.Error("handler ran on an unmigrated schema")
		return nil, nil
	})
	_, err = h(outbox.NewMessage([]byte("x")))
	if !errors.Is(err, migrations.ErrNotMigrated) || !strings.Contains(err.Error(), "onceflow migrate up --schema "+db.Schema) {
		t.Fatalf("handle = %v, want ErrNotMigrated naming the command", err)
	}
	if _, err := migrations.Up(ctx, db.Pool, migrations.Options{Schema: db.Schema}); err != nil {
		t.Fatal(err)
	}
	if err := ib.CheckSchema(ctx); err != nil {
		t.Fatalf("CheckSchema after Up = %v", err)
	}
}
