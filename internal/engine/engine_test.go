package engine_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/internal/engine"
	"github.com/onceflow/onceflow/internal/testdb"
)

// unit claims keys and, for each new one, runs do; start, when set, is its pre-claim hook.
type unit struct {
	r       *engine.Runner
	keys    []string
	do      func(tx pgx.Tx, i int) error
	written bool
}

func (u *unit) Apply(ctx context.Context, tx pgx.Tx) ([]int, error) {
	claimed, err := u.r.ClaimTx(ctx, tx, u.keys...)
	if err != nil {
		return nil, err
	}
	var applied []int
	for i, ok := range claimed {
		if !ok {
			continue
		}
		if u.do != nil {
			if err := engine.Blame(ctx, u.do(tx, i), tx.Conn(), i); err != nil {
				return nil, err
			}
		}
		applied = append(applied, i)
	}
	return applied, nil
}

func (u *unit) Write(context.Context, pgx.Tx) error { u.written = true; return nil }

type starter struct {
	*unit
	start func(pgx.Tx) (bool, error)
}

func (s *starter) Start(_ context.Context, tx pgx.Tx) (bool, error) { return s.start(tx) }

// Run says what it did, and keeps exactly what it says: applied messages commit with their
// dedup rows; a batch of duplicates is rolled back, unless a pre-claim hook ran (a replay's
// state change is kept); a hook that finds nothing to do rolls back; a handler's error is the
// message's, and nothing of its transaction is kept.
func TestRunOutcomes(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	r := newRunner(t, db, "billing")
	ctx := context.Background()
	mustExec(t, db, `CREATE TABLE `+db.Table("marks")+` (v text)`)
	marks := func() int {
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+db.Table("marks")).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	mark := func(tx pgx.Tx, _ int) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+db.Table("marks")+` VALUES ('x')`)
		return err
	}

	u := &unit{r: r, keys: []string{"a", "b"}, do: mark}
	if res, err := r.Run(ctx, 2, u); err != nil || res.Outcome != engine.Applied || len(res.Applied) != 2 || !u.written || marks() != 2 {
		t.Fatalf("new keys: %+v %v, written %v, %d marks", res, err, u.written, marks())
	}
	u = &unit{r: r, keys: []string{"a", "b"}, do: mark}
	if res, err := r.Run(ctx, 2, u); err != nil || res.Outcome != engine.Duplicate || u.written || marks() != 2 {
		t.Fatalf("duplicates: %+v %v, written %v, %d marks", res, err, u.written, marks())
	}
	hook := func(tx pgx.Tx) (bool, error) { return true, mark(tx, 0) }
	s := &starter{unit: &unit{r: r, keys: []string{"a"}}, start: hook}
	if res, err := r.Run(ctx, 1, s); err != nil || res.Outcome != engine.Duplicate || !s.written || marks() != 3 {
		t.Fatalf("a started duplicate: %+v %v, written %v, %d marks (the hook's change is kept)", res, err, s.written, marks())
	}
	s = &starter{unit: &unit{r: r, keys: []string{"c"}}, start: func(tx pgx.Tx) (bool, error) { return false, mark(tx, 0) }}
	if res, err := r.Run(ctx, 1, s); err != nil || res.Outcome != engine.NotStarted || marks() != 3 {
		t.Fatalf("not started: %+v %v, %d marks", res, err, marks())
	}
	u = &unit{r: r, keys: []string{"c", "d"}, do: func(tx pgx.Tx, i int) error {
		if i == 1 {
			return errors.New("card declined")
		}
		return mark(tx, i)
	}}
	_, err := r.Run(ctx, 2, u)
	var me *engine.MessageError
	if !errors.As(err, &me) || me.Index != 1 || marks() != 3 {
		t.Fatalf("a handler's error: %v, %d marks", err, marks())
	}
	if seen := claimedBefore(t, r, db, "c"); seen {
		t.Fatal("the failed transaction's dedup row was kept")
	}
	// A deadline that passed before the transaction began is the message's: nothing was asked
	// of the database.
	dctx, cancel := context.WithTimeout(ctx, 0)
	defer cancel()
	if _, err := r.Run(dctx, 1, &unit{r: r, keys: []string{"e"}}); !errors.As(err, &me) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("an expired message deadline: %v", err)
	}
}

func claimedBefore(t *testing.T, r *engine.Runner, db *testdb.DB, key string) bool {
	t.Helper()
	var seen bool
	err := pgx.BeginFunc(context.Background(), db.Pool, func(tx pgx.Tx) (err error) {
		seen, err = r.SeenTx(context.Background(), tx, key)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return seen
}

func mustExec(t *testing.T, db *testdb.DB, sql string) {
	t.Helper()
	if _, err := db.Pool.Exec(context.Background(), sql); err != nil {
		t.Fatal(err)
	}
}

type refusal struct{ i int }

func (r *refusal) Error() string     { return fmt.Sprintf("refused message %d", r.i) }
func (r *refusal) MessageIndex() int { return r.i }

// Refused maps the outbox's refusal of a written message to the batch message whose handler
// returned it; a refusal it cannot place splits the batch (−1); other errors pass.
func TestRefused(t *testing.T) {
	origin := []int{4, 4, 7}
	for _, c := range []struct {
		err  error
		want int // −2: returned as it is
	}{
		{fmt.Errorf("write: %w", &refusal{2}), 7},
		{&refusal{0}, 4},
		{&refusal{9}, -1},
		{&refusal{-1}, -1},
		{&pgconn.PgError{Code: "40P01"}, -2},
	} {
		err := engine.Refused(c.err, origin)
		var me *engine.MessageError
		switch {
		case c.want == -2 && err != c.err:
			t.Errorf("Refused(%v) = %v, want it unchanged", c.err, err)
		case c.want != -2 && (!errors.As(err, &me) || me.Index != c.want):
			t.Errorf("Refused(%v) = %v, want message %d", c.err, err, c.want)
		}
		if c.want != -2 && !engine.Unfixable(err) {
			t.Errorf("Unfixable(%v) = false", err)
		}
	}
	if err := engine.Refused(&refusal{0}, nil); !errors.As(err, new(*engine.MessageError)) {
		t.Errorf("a set handler's refusal: %v", err)
	}
}

// RetryPolicy's zero value is usable: the defaults, and slog.Default for the log.
func TestRetryPolicyZeroValue(t *testing.T) {
	p := &countingProcessor{fail: errors.New("always")}
	if err := (engine.RetryPolicy{Backoff: 1}).ApplyOne(context.Background(), p, message.NewMessage("u-1", nil), "src", nil); err != nil {
		t.Fatal(err)
	}
	if p.calls != engine.DefaultMaxAttempts || p.givenUp != engine.DefaultMaxAttempts {
		t.Fatalf("%d attempts, given up after %d; want %d", p.calls, p.givenUp, engine.DefaultMaxAttempts)
	}
}

type countingProcessor struct {
	fail           error
	calls, givenUp int
}

func (p *countingProcessor) ProcessBatch(context.Context, []*message.Message) error {
	p.calls++
	return &engine.MessageError{Index: 0, Err: p.fail}
}

func (p *countingProcessor) SettlePoison(_ context.Context, _ *message.Message, g engine.GiveUp) error {
	p.givenUp = g.Attempts
	return nil
}
