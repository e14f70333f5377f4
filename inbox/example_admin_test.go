package inbox_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
)

// An operator's tools, as `onceflow inbox poison` and the console use them: list what a
// consumer gave up on, and once the fix is deployed, request a replay in a transaction. A
// running process of the consumer then applies it exactly once (Inbox.RouterPlugin, or
// inboxkafka.BatchConsumer).
func ExampleAdmin() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{NoKafka: true}) // a throwaway, migrated database
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	// A consumer gives a message up (what its Poison middleware or batched consumer does).
	ib, err := inbox.New(inbox.Config{Pool: env.Pool, Schema: env.Schema, Consumer: "billing"})
	if err != nil {
		fmt.Println(err)
		return
	}
	msg := outbox.NewMessage([]byte(`{"order":"o-1"}`))
	if err := ib.SettlePoison(ctx, msg, inbox.GiveUp{Source: "orders/0@42", Attempts: 5, Err: errors.New("invoice service: 503")}); err != nil {
		fmt.Println(err)
		return
	}

	admin, err := inbox.NewAdmin(env.Schema)
	if err != nil {
		fmt.Println(err)
		return
	}
	rows, err := admin.Poison(ctx, env.Pool, inbox.PoisonFilter{Consumer: "billing"})
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, r := range rows {
		fmt.Println(r.Consumer, r.Source, r.Attempts, r.State, r.Error)
	}
	var res inbox.ReplayResult
	err = pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
		var err error
		res, err = admin.ReplayTx(ctx, tx, inbox.ReplayFilter{Consumer: "billing", By: "ops:alice"})
		return err
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	row, err := admin.PoisonByID(ctx, env.Pool, res.Requested[0])
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("replay requested:", row.State, row.History[0]["by"])
	// Output:
	// billing orders/0@42 5 poison invoice service: 503
	// replay requested: replay_requested ops:alice
}
