package saga_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/saga"
)

// The saga engine's given-up messages refuse `onceflow inbox poison replay`, saying what to do
// instead: a reply whose saga was set stuck points at `onceflow saga retry <id>` (a replay
// would apply an old reply to a saga that may have moved on); an invalid command could only
// fail again. A valid command given up by a participant was answered as a failed attempt and
// left no poison row: there is nothing to replay.
func TestGivenUpSagaMessagesRefuseReplay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newWorld(t, checkoutDef(t, nil), "reserve")
	id := w.start("o-1")
	reply := outbox.SetSaga(outbox.NewMessage([]byte(`{"id":"r-1"}`)), outbox.SagaRef{ID: id, Step: "reserve", Phase: outbox.SagaPhaseAction, Attempt: 1})
	reply.Metadata.Set(outbox.MetadataSagaName, "checkout")
	reply.Metadata.Set(outbox.MetadataSagaOutcome, outbox.SagaOutcomeDone)
	if err := w.orch.SettlePoison(ctx, reply, inbox.GiveUp{Attempts: 5, Err: errors.New("OnReply: bug")}); err != nil {
		t.Fatal(err)
	}
	if d := w.get(id); d.State != saga.StateStuck {
		t.Fatalf("saga after its reply was given up: %s", d.State)
	}
	proc := saga.ActionProcessor(w.participant("charge"), w.action("charge"))
	invalid := outbox.NewMessage([]byte(`{}`)) // no saga metadata
	if err := proc.SettlePoison(ctx, invalid, inbox.GiveUp{Attempts: 1, Err: errors.New("not a command")}); err != nil {
		t.Fatal(err)
	}
	if n := w.count(`SELECT count(*) FROM ` + w.db.Schema + `.inbox_poison`); n != 2 {
		t.Fatalf("%d poison rows, want the reply's and the invalid command's", n)
	}
	var res inbox.ReplayResult
	admin, err := inbox.NewAdmin(w.db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, w.db.Pool, func(tx pgx.Tx) error {
		var err error
		res, err = admin.ReplayTx(ctx, tx, inbox.ReplayFilter{All: true})
		return err
	})
	if !errors.Is(err, inbox.ErrReplayRefused) || len(res.Refused) != 2 || len(res.Requested) != 0 {
		t.Fatalf("replay of the saga's poison rows: %v %+v", err, res)
	}
	for _, want := range []string{"a saga reply", "onceflow saga retry " + id, "not valid for its participant"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the refusal does not say %q: %v", want, err)
		}
	}
	if n := w.count(`SELECT count(*) FROM ` + w.db.Schema + `.inbox_poison WHERE state = 'poison'`); n != 2 {
		t.Errorf("a refused replay changed %d rows", 2-n)
	}
}
