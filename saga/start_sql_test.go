package saga_test

import (
	"context"
	"errors"
	"reflect"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/stdlib"

	"github.com/onceflow/onceflow/saga"
)

// StartSQLTx stores what StartTx stores — the saga row, its step timer and deadline, its
// first command — and the saga then runs to completion; a second start with the same id is a
// no-op, with another definition's id ErrIDInUse; a rollback leaves nothing.
func TestStartSQLTxStoresWhatStartTxStores(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	def := checkoutDef(t, func(_ string, s *saga.StepDef[Checkout]) { s.Timeout(time.Hour) }, saga.WithDeadline(2*time.Hour))
	w := newWorld(t, def)
	db := stdlib.OpenDBFromPool(w.db.Pool)
	defer db.Close()

	startSQL := func(order string, d *saga.Definition[Checkout], commit bool) (string, error) {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return "", err
		}
		defer func() { _ = tx.Rollback() }()
		id, err := saga.StartSQLTx(ctx, tx, d, Checkout{Order: order, Amount: 42}, saga.WithID(order), saga.WithWriter(w.writer()))
		if err != nil || !commit {
			return id, err
		}
		return id, tx.Commit()
	}
	if _, err := startSQL("rolled-back", def, false); err != nil {
		t.Fatal(err)
	}
	if n := w.count(`SELECT count(*) FROM ` + w.db.Table("saga")); n != 0 {
		t.Fatalf("a rolled-back start left %d sagas", n)
	}
	w.start("via-pgx")
	for range 2 { // the second start is a retried request: no-op
		if id, err := startSQL("via-sql", def, true); err != nil || id != "via-sql" {
			t.Fatalf("StartSQLTx = %q, %v", id, err)
		}
	}
	other, err := saga.Define("other", 1, []*saga.StepDef[Checkout]{saga.Step[Checkout]("only").
		Send("cmd.only", func(c Checkout) (any, error) { return stepCmd{Order: c.Order}, nil })})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := startSQL("via-sql", other, true); !errors.Is(err, saga.ErrIDInUse) {
		t.Fatalf("err = %v, want ErrIDInUse", err)
	}

	// Both starts wrote the same rows, apart from the id, event ids and times.
	shape := func(id string) []any {
		var state, waiting string
		var step, attempt, timers, commands, recorded int
		var data, steps, trace string
		// recorded: the row says where its command is (the event id and the writing
		// transaction: Admin.Get's bounded lookup), and the outbox agrees.
		if err := w.db.Pool.QueryRow(ctx, `SELECT state, waiting, step, attempt, data::text, (SELECT string_agg(e->>'status', ',') FROM jsonb_array_elements(steps) e), trace::text,
			(SELECT count(*) FROM `+w.db.Table("saga_timer")+` WHERE saga_id = $1),
			(SELECT count(*) FROM `+w.db.Table("outbox")+` WHERE metadata->>'saga_id' = $1),
			(SELECT count(*) FROM `+w.db.Table("outbox")+` o WHERE o.tx = s.command_tx AND o.event_id = s.command_event AND o.metadata->>'saga_id' = $1)
			FROM `+w.db.Table("saga")+` s WHERE id = $1`, id).Scan(&state, &waiting, &step, &attempt, &data, &steps, &trace, &timers, &commands, &recorded); err != nil {
			t.Fatal(err)
		}
		return []any{state, waiting, step, attempt, len(data), steps, trace, timers, commands, recorded}
	}
	got, want := shape("via-sql"), shape("via-pgx")
	if !reflect.DeepEqual(got, want) || want[7] != 2 || want[8] != 1 || want[9] != 1 {
		t.Fatalf("StartSQLTx stored %v, StartTx %v (want 2 timers and 1 command, recorded)", got, want)
	}
	if d := w.runUntil("via-sql", saga.StateCompleted); d.State != saga.StateCompleted {
		t.Fatalf("state %s", d.State)
	}
}
