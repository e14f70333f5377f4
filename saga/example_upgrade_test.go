package saga_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/saga"
	"github.com/onceflow/onceflow/saga/sagatest"
)

// upgrade:begin
// Parcel is the data of version 1 of the delivery saga: the weight in grams.
type Parcel struct {
	Order string `json:"order"`
	Grams int    `json:"grams"`
}

// ParcelV2 is version 2's: the weight in kilograms, and the tracking number.
type ParcelV2 struct {
	Order     string  `json:"order"`
	Kilograms float64 `json:"kilograms"`
	Tracking  string  `json:"tracking,omitempty"`
}

// delivery books a courier, then prints the label. A busy courier is asked again five
// minutes later: meanwhile the saga waits at a step boundary.
var delivery = saga.MustDefine("delivery", 1, []*saga.StepDef[Parcel]{
	saga.Step[Parcel]("book-courier").
		Send("courier.book", func(p Parcel) (any, error) { return p, nil }).
		Attempts(5, 5*time.Minute),
	saga.Step[Parcel]("print-label").
		Send("labels.print", func(p Parcel) (any, error) { return p, nil }),
})

// deliveryV2 books a carrier instead (the step renamed, its command on a new topic), weighs
// in kilograms, and starts tracking the parcel (a new step). It takes over the running sagas
// of version 1: their data converted, book-courier's history carried over to book-carrier.
var deliveryV2 = saga.MustDefine("delivery", 2, []*saga.StepDef[ParcelV2]{
	saga.Step[ParcelV2]("book-carrier").
		Send("carrier.book", func(p ParcelV2) (any, error) { return p, nil }).
		Attempts(3, time.Second),
	saga.Step[ParcelV2]("print-label").
		Send("labels.print.v2", func(p ParcelV2) (any, error) { return p, nil }),
	saga.Step[ParcelV2]("track").
		Send("tracking.start", func(p ParcelV2) (any, error) { return p, nil }).
		OnReply(func(p *ParcelV2, r saga.Reply) error { return r.Decode(&p.Tracking) }),
}, saga.Upgrade(1, func(p Parcel) (ParcelV2, error) {
	if p.Grams <= 0 {
		return ParcelV2{}, fmt.Errorf("weight %d g: weigh the parcel again", p.Grams)
	}
	return ParcelV2{Order: p.Order, Kilograms: float64(p.Grams) / 1000}, nil
}, saga.StepMap{"book-courier": "book-carrier"}))

// upgrade:end

// upgrade-run:begin
// upgradeDeliveries moves the running deliveries of version 1 onto version 2, in the service
// that has both definitions: a dry run first, which changes nothing, then the upgrade, one
// transaction per saga. Sagas that are not at a step boundary (a command in flight,
// compensating) or whose data does not convert are refused, each with the reason, and go on
// as they were.
func upgradeDeliveries(ctx context.Context, pool *pgxpool.Pool) error {
	admin, err := saga.NewAdmin("", delivery, deliveryV2)
	if err != nil {
		return err
	}
	plan, err := admin.UpgradeMatching(ctx, pool, deliveryV2, 1, saga.BulkOptions{DryRun: true})
	if err != nil {
		return err
	}
	for _, u := range plan.Upgraded {
		fmt.Printf("%s would go on at %s with %s:\n", u.ID, u.NewStep, u.Data)
		for _, m := range u.Moves {
			fmt.Println("  ", m)
		}
	}
	for _, r := range plan.Refused {
		fmt.Println(r.Err)
	}
	res, err := admin.UpgradeMatching(ctx, pool, deliveryV2, 1, saga.BulkOptions{Limit: 1000})
	if err != nil {
		return err
	}
	fmt.Printf("%d upgraded, %d refused\n", len(res.Upgraded), len(res.Refused))
	return nil
}

// upgrade-run:end

// Two deliveries of version 1 wait to ask a busy courier again, five minutes later. Version 2
// takes them over: order-1 is upgraded, at once re-sends its booking to the carrier (version
// 2's backoff has passed) and goes on to print the label and track the parcel; order-2's
// weight does not convert, so it stays on version 1. The saga's history records the upgrade.
func ExampleUpgrade() {
	ctx := context.Background()
	env, err := onceflowtest.Start(ctx, onceflowtest.Options{NoKafka: true})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	pool := env.Pool

	// The orchestrators run both versions before anything is upgraded.
	orch, err := saga.NewOrchestrator(saga.OrchestratorConfig{Pool: pool})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := errors.Join(saga.Register(orch, delivery), saga.Register(orch, deliveryV2)); err != nil {
		fmt.Println(err)
		return
	}
	bus := sagatest.NewBus(pool, env.Schema)
	bus.Orchestrate(orch)
	shipping, err := saga.NewParticipant(saga.ParticipantConfig{Pool: pool, Consumer: "shipping"})
	if err != nil {
		fmt.Println(err)
		return
	}
	bus.Subscribe("courier.book", saga.Action(shipping, func(context.Context, pgx.Tx, Parcel) (struct{}, error) {
		return struct{}{}, saga.Retry(errors.New("the courier is busy"))
	}))
	ok := func(context.Context, pgx.Tx, ParcelV2) (struct{}, error) { return struct{}{}, nil }
	bus.Subscribe("carrier.book", saga.Action(shipping, ok))
	bus.Subscribe("labels.print.v2", saga.Action(shipping, ok))
	bus.Subscribe("tracking.start", saga.Action(shipping, func(context.Context, pgx.Tx, ParcelV2) (string, error) {
		return "TRK-0001", nil
	}))

	for _, p := range []Parcel{{Order: "order-1", Grams: 1250}, {Order: "order-2", Grams: 0}} {
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := saga.StartTx(ctx, tx, delivery, p, saga.WithID(p.Order))
			return err
		}); err != nil {
			fmt.Println(err)
			return
		}
	}
	admin, err := saga.NewAdmin("")
	if err != nil {
		fmt.Println(err)
		return
	}
	get := func(id string) *saga.Detail {
		d, err := admin.Get(ctx, pool, id)
		if err != nil {
			panic(err)
		}
		return d
	}
	waiting := func(id string) bool { w := get(id).Wait; return w != nil && w.For == saga.WaitResend }
	if err := bus.RunUntil(ctx, func() bool { return waiting("order-1") && waiting("order-2") }); err != nil {
		fmt.Println(err)
		return
	}

	if err := upgradeDeliveries(ctx, pool); err != nil {
		fmt.Println(err)
		return
	}
	if err := bus.RunUntil(ctx, func() bool { return get("order-1").State.Finished() }); err != nil {
		fmt.Println(err)
		return
	}
	for _, id := range []string{"order-1", "order-2"} {
		d := get(id)
		fmt.Printf("%s: version %d, %s at %s, data %s\n", id, d.Version, d.State, d.Step, d.Data)
	}
	for _, u := range get("order-1").Upgrades() {
		fmt.Printf("order-1 was upgraded from version %d to %d at step %s → %s\n", u.From, u.To, u.Step, u.NewStep)
	}
	// Output:
	// order-1 would go on at book-carrier with {"order":"order-1","kilograms":1.25}:
	//    book-courier → book-carrier (running)
	//    print-label (pending)
	//    + track (new)
	// saga: not upgradable: saga "order-2": its data does not convert to version 2: weight 0 g: weigh the parcel again
	// 1 upgraded, 1 refused
	// order-1: version 2, completed at track, data {"order": "order-1", "tracking": "TRK-0001", "kilograms": 1.25}
	// order-2: version 1, running at book-courier, data {"grams": 0, "order": "order-2"}
	// order-1 was upgraded from version 1 to 2 at step book-courier → book-carrier
}
