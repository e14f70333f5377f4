package main

import (
	"context"
	"fmt"
	"os"
	"text/tabwriter"
	"time"

	"github.com/onceflow/onceflow/examples/internal/checkout"
)

// row is one line of the invariant table.
type row struct {
	name, value string
	ok          bool
}

// check computes the invariants from the services' tables (all in one database, so the demo
// can join across schemas; the services themselves never do) and their counters.
func (s *shop) check(ctx context.Context, o options, lost int) ([]row, error) {
	for _, sv := range s.services() {
		sv.counters.poll(sv.addr)
	}
	orders, res, pay, proj := t(s.orders, "orders"), t(s.inventory, "reservation"), t(s.payments, "payment"), t(s.projection, "order_projection")
	providerCharges := t(s.payments, "fake_provider_charge")
	var v struct {
		orders, pending, confirmed, cancelled, outOfStock, declined int64
		sagas, completed, compensated                               int64
		confirmedBad, cancelledBad, keysTwice                       int64
		stockBad, projBad, counterBad, customers                    int64
		outbox, parked, distinctReplies, providerReplays            int64
	}
	skus, stock := []string{}, []int{}
	for _, p := range checkout.Catalogue {
		skus, stock = append(skus, p.SKU), append(stock, p.Stock)
	}
	q := `SELECT
		(SELECT count(*) FROM ` + orders + `),
		(SELECT count(*) FROM ` + orders + ` WHERE status = 'pending'),
		(SELECT count(*) FROM ` + orders + ` WHERE status = 'confirmed'),
		(SELECT count(*) FROM ` + orders + ` WHERE status = 'cancelled'),
		(SELECT count(*) FROM ` + orders + ` WHERE status = 'cancelled' AND reason LIKE '%out of stock%'),
		(SELECT count(*) FROM ` + orders + ` WHERE status = 'cancelled' AND reason LIKE '%declined%'),
		(SELECT count(*) FROM ` + t(s.orders, "saga") + `),
		(SELECT count(*) FROM ` + t(s.orders, "saga") + ` WHERE state = 'completed'),
		(SELECT count(*) FROM ` + t(s.orders, "saga") + ` WHERE state = 'compensated'),
		-- every confirmed order: exactly one payment, one reservation, one charge at the provider
		(SELECT count(*) FROM ` + orders + ` o WHERE o.status = 'confirmed' AND (
			(SELECT count(*) FROM ` + pay + ` p WHERE p.order_id = o.id::text AND p.status = 'charged' AND p.amount = o.amount) <> 1 OR
			(SELECT count(*) FROM ` + pay + ` p WHERE p.order_id = o.id::text) <> 1 OR
			(SELECT count(*) FROM ` + res + ` r WHERE r.order_id = o.id::text AND r.status = 'reserved' AND r.quantity = o.quantity) <> 1 OR
			(SELECT count(*) FROM ` + providerCharges + ` c WHERE c.idempotency_key = 'saga:' || o.id || ':charge' AND NOT c.declined AND NOT c.refunded) <> 1)),
		-- every cancelled order: nothing reserved, nothing charged (net of refunds)
		(SELECT count(*) FROM ` + orders + ` o WHERE o.status = 'cancelled' AND (
			EXISTS (SELECT FROM ` + res + ` r WHERE r.order_id = o.id::text AND r.status = 'reserved') OR
			EXISTS (SELECT FROM ` + pay + ` p WHERE p.order_id = o.id::text AND p.status = 'charged') OR
			EXISTS (SELECT FROM ` + providerCharges + ` c WHERE c.idempotency_key = 'saga:' || o.id || ':charge' AND NOT c.declined AND NOT c.refunded))),
		(SELECT count(*) FROM (SELECT FROM ` + orders + ` GROUP BY customer_id, idempotency_key HAVING count(*) > 1) x),
		-- stock: what is left = what there was − what confirmed orders hold
		(SELECT count(*) FROM unnest($1::text[], $2::int[]) AS c(sku, initial) JOIN ` + t(s.inventory, "stock") + ` st USING (sku)
			WHERE st.available <> c.initial - (SELECT coalesce(sum(quantity), 0) FROM ` + res + ` r WHERE r.sku = c.sku AND r.status = 'reserved')),
		(SELECT count(*) FROM ` + orders + ` o FULL JOIN ` + proj + ` p ON p.order_id = o.id::text
			WHERE o.id IS NULL OR p.order_id IS NULL OR p.status <> o.status OR p.version <> o.version OR p.reason <> o.reason),
		(SELECT count(*) FROM (SELECT customer_id, count(*) AS n FROM ` + orders + ` GROUP BY 1) o
			FULL JOIN ` + t(s.projection, "customer_orders") + ` c USING (customer_id) WHERE o.n IS DISTINCT FROM c.orders),
		(SELECT count(DISTINCT customer_id) FROM ` + orders + `),
		(SELECT (SELECT count(*) FROM ` + t(s.orders, "outbox") + `) + (SELECT count(*) FROM ` + t(s.inventory, "outbox") + `) + (SELECT count(*) FROM ` + t(s.payments, "outbox") + `)),
		(SELECT (SELECT count(*) FROM ` + t(s.orders, "outbox_parked") + `) + (SELECT count(*) FROM ` + t(s.inventory, "outbox_parked") + `) + (SELECT count(*) FROM ` + t(s.payments, "outbox_parked") + `)),
		(SELECT count(*) FROM ` + t(s.orders, "processed_event") + ` WHERE consumer = 'onceflow-saga'),
		(SELECT coalesce(sum(requests - 1), 0) FROM ` + providerCharges + `)`
	err := s.pool.QueryRow(ctx, q, skus, stock).Scan(&v.orders, &v.pending, &v.confirmed, &v.cancelled, &v.outOfStock, &v.declined,
		&v.sagas, &v.completed, &v.compensated, &v.confirmedBad, &v.cancelledBad, &v.keysTwice, &v.stockBad, &v.projBad,
		&v.counterBad, &v.customers, &v.outbox, &v.parked, &v.distinctReplies, &v.providerReplays)
	if err != nil {
		return nil, fmt.Errorf("invariant query: %w", err)
	}
	rem, err := s.checkReminders(ctx, o)
	if err != nil {
		return nil, err
	}
	later, err := s.checkRetryLater(ctx, o)
	if err != nil {
		return nil, err
	}
	c, tp := s.client, s.topics
	accepted := c.accepted.Load()
	inj := func(topics ...string) int64 {
		var n int64
		for _, topic := range topics {
			n += s.rep.injected(topic)
		}
		return n
	}
	absorbed := func(name string, got, injected int64, note string) row {
		return row{"  " + name, fmt.Sprintf("%d absorbed, %d injected%s", got, injected, note), got >= injected && (injected == 0 || got > 0)}
	}
	repliesDup := s.orders.counters.get("replies_delivered") - v.distinctReplies
	paymentsDup := s.payments.counters.get("barrier_duplicates")
	selfSent := s.rep.received(tp.PlaceOrder) + s.rep.received(tp.ConfirmOrder) + s.rep.received(tp.CancelOrder)
	rows := []row{
		{"orders accepted = orders stored = sagas started = sagas finished",
			fmt.Sprintf("%d = %d = %d = %d (%d completed + %d compensated)", accepted, v.orders, v.sagas, v.completed+v.compensated, v.completed, v.compensated),
			accepted == v.orders && v.orders == v.sagas && v.sagas == v.completed+v.compensated && accepted > 0},
		{"every order finished: confirmed + cancelled",
			fmt.Sprintf("%d + %d, %d pending (cancelled: %d out of stock, %d payment declined)", v.confirmed, v.cancelled, v.pending, v.outOfStock, v.declined),
			v.pending == 0 && v.confirmed == v.completed && v.cancelled == v.compensated && v.declined > 0},
		{"every confirmed order: one payment, one reservation, one provider charge",
			fmt.Sprintf("%d/%d", v.confirmed-v.confirmedBad, v.confirmed), v.confirmedBad == 0},
		{"every cancelled order: stock back, no net charge", fmt.Sprintf("%d/%d", v.cancelled-v.cancelledBad, v.cancelled), v.cancelledBad == 0},
		{"stock left = initial stock − confirmed reservations", fmt.Sprintf("%d/%d products", int64(len(skus))-v.stockBad, len(skus)), v.stockBad == 0},
		{"clients retried with the same key", fmt.Sprintf("%d replayed; %d got 409 while the first was in flight; %d after a dropped connection (%d never began)",
			c.replays.Load(), c.inflight.Load(), c.dropped.Load(), s.orders.counters.get("http_canceled")), c.replays.Load() > 0 && c.dropped.Load() > 0},
		{"no Idempotency-Key produced two orders", fmt.Sprintf("%d in the table, %d seen by clients", v.keysTwice, c.keysWithTwoOrders()),
			v.keysTwice == 0 && c.keysWithTwoOrders() == 0},
		{"a key reused with another body is refused (422)", fmt.Sprintf("%d/%d", c.reuseRefused.Load(), c.reuses.Load()), c.reuseRefused.Load() == c.reuses.Load()},
		{"the projection matches the orders table",
			fmt.Sprintf("%d rows differ, %d of %d customer counters differ", v.projBad, v.counterBad, v.customers), v.projBad == 0 && v.counterBad == 0},
		// The orders service's own steps (place-order, confirm, and cancel as compensation)
		// are local steps of checkout version 2: they run in the orchestrator's transitions,
		// so nothing is sent to orders.place/confirm/cancel and the orders participant's
		// barrier (version 1 only) has nothing to absorb. This row replaces the former
		// "saga barrier, orders" one, which counted duplicates of those self-sent commands.
		{"orders' own steps ran as local steps, no command sent to itself",
			fmt.Sprintf("%d local runs, %d failed; %d commands on orders.place/confirm/cancel", s.orders.counters.get("local_steps"),
				s.orders.counters.get("local_step_failures"), selfSent),
			s.orders.counters.get("local_steps") >= v.orders+v.completed+v.compensated && s.orders.counters.get("local_step_failures") == 0 && selfSent == 0},
		rem,
		later,
		{"outboxes drained (orders, inventory, payments)", fmt.Sprintf("%d rows left, %d parked", v.outbox, v.parked), v.outbox == 0 && v.parked == 0},
		{"duplicates absorbed, by barrier:", "", true},
		{"  HTTP Idempotency-Key (stored response replayed)", fmt.Sprintf("%d replays", s.orders.counters.get("http_replayed")), s.orders.counters.get("http_replayed") > 0},
		absorbed("orchestrator reply dedup", repliesDup, inj(tp.Replies), ""),
		absorbed("saga barrier, inventory", s.inventory.counters.get("barrier_duplicates"), inj(tp.Reserve, tp.Release), ""),
		{"  saga barrier, payments", fmt.Sprintf("%d absorbed, %d injected (its counters die with each SIGKILL)", paymentsDup, inj(tp.Charge, tp.Refund)),
			inj(tp.Charge, tp.Refund) == 0 || paymentsDup > 0},
		absorbed("projection inbox (processed_event)", s.projection.counters.get("inbox_duplicates"), inj(tp.OrderEvents, tp.Reminders), ""),
		{"  payment provider idempotency key", fmt.Sprintf("%d repeated charges answered with the first", v.providerReplays), v.providerReplays >= int64(lost)},
		{"  UNIQUE (payment_provider, external_payment_id)", fmt.Sprintf("%d caught, of %d charges redelivered without dedup rows",
			s.payments.counters.get("unique_constraint_hits"), lost), s.payments.counters.get("unique_constraint_hits") >= int64(lost) && lost == o.lostDedup},
		{"crashes: orders relay and payments SIGKILLed, restarted",
			fmt.Sprintf("%d + %d kills, %d + %d restarts", s.relays["orders"].kills, s.payments.kills, s.relays["orders"].restarts, s.payments.restarts),
			s.relays["orders"].kills == 1 && s.payments.kills == 1 && s.relays["orders"].restarts == 1 && s.payments.restarts == 1},
	}
	if o.ha {
		rows = append(rows, row{"PostgreSQL failover: primary killed, synchronous standby promoted", fmt.Sprintf("%d failover", s.failovers), s.failovers == 1})
	}
	return rows, nil
}

// checkReminders: every order scheduled a reminder with its own transaction; a confirmed
// order's was received once, never before its time; a cancelled order's was withdrawn in the
// cancellation's transaction (never received), or reported too late there, once it was due
// (received once). How many are too late depends on how far the sagas lag behind the orders.
func (s *shop) checkReminders(ctx context.Context, o options) (row, error) {
	orders, rem := t(s.orders, "orders"), t(s.projection, "order_reminder")
	var v struct {
		confirmed, confirmedOnce, twice, early, cancelled, withdrawn, tooLate, scheduled int64
		earliest, latest                                                                 float64
	}
	err := s.pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM `+orders+` WHERE status = 'confirmed'),
		(SELECT count(*) FROM `+orders+` o JOIN `+rem+` r ON r.order_id = o.id::text WHERE o.status = 'confirmed' AND r.reminders = 1),
		(SELECT count(*) FROM `+rem+` WHERE reminders > 1),
		-- before its time: its order's transaction time plus the delay, on the database's clock
		(SELECT count(*) FROM `+orders+` o JOIN `+rem+` r ON r.order_id = o.id::text
			WHERE r.received_at < o.created_at + $1 * interval '1 microsecond'),
		(SELECT count(*) FROM `+orders+` WHERE status = 'cancelled'),
		(SELECT count(*) FROM `+orders+` o WHERE o.status = 'cancelled' AND o.reminder = 'withdrawn'
			AND NOT EXISTS (SELECT FROM `+rem+` r WHERE r.order_id = o.id::text)),
		-- too late: found gone when it was due (so moved to be published), and received once
		(SELECT count(*) FROM `+orders+` o JOIN `+rem+` r ON r.order_id = o.id::text
			WHERE o.status = 'cancelled' AND o.reminder = 'too late' AND r.reminders = 1
				AND o.reminder_cancel >= o.created_at + $1 * interval '1 microsecond'),
		(SELECT count(*) FROM `+t(s.orders, "outbox_scheduled")+`),
		(SELECT coalesce(extract(epoch FROM min(r.received_at - o.created_at)), 0) FROM `+orders+` o JOIN `+rem+` r ON r.order_id = o.id::text),
		(SELECT coalesce(extract(epoch FROM max(r.received_at - o.created_at)), 0) FROM `+orders+` o JOIN `+rem+` r ON r.order_id = o.id::text)`, o.remindAfter.Microseconds()).
		Scan(&v.confirmed, &v.confirmedOnce, &v.twice, &v.early, &v.cancelled, &v.withdrawn, &v.tooLate, &v.scheduled, &v.earliest, &v.latest)
	if err != nil {
		return row{}, fmt.Errorf("reminders query: %w", err)
	}
	return row{"reminders: one per confirmed order, none early, cancelled ones withdrawn",
		fmt.Sprintf("%d/%d once (%d twice), %d before due (due %s after the order, received %.1f–%.1fs after); cancelled %d: %d withdrawn, %d too late; %d waiting",
			v.confirmedOnce, v.confirmed, v.twice, v.early, o.remindAfter, v.earliest, v.latest, v.cancelled, v.withdrawn, v.tooLate, v.scheduled),
		v.confirmed > 0 && v.confirmedOnce == v.confirmed && v.twice == 0 && v.early == 0 &&
			v.withdrawn+v.tooLate == v.cancelled && v.scheduled == 0}, nil
}

// checkRetryLater: the charges the provider refused while it was down were answered as retries
// carrying the charge's wait (inbox.RetryAfter), re-sent by the orchestrator no sooner, and
// their orders settled as if nothing had happened: charged and confirmed, or declined.
func (s *shop) checkRetryLater(ctx context.Context, o options) (row, error) {
	var refused, retries, retried, completed, declined, early int64
	var firstResend float64
	err := s.pool.QueryRow(ctx, `WITH r AS (
			SELECT g.id, g.state, (rp->>'at')::timestamptz AS at,
				(SELECT min((c->>'at')::timestamptz) FROM jsonb_array_elements(st->'sent') c
					WHERE c->>'phase' = 'action' AND (c->>'attempt')::int = (rp->>'attempt')::int + 1) AS resent_at
			FROM `+t(s.orders, "saga")+` g, jsonb_array_elements(g.steps) st, jsonb_array_elements(coalesce(st->'replies', '[]')) rp
			WHERE st->>'name' = 'charge' AND rp->>'phase' = 'action' AND rp->>'outcome' = 'retry' AND rp->>'reason' LIKE '%unavailable%')
		SELECT (SELECT coalesce(sum(refused), 0) FROM `+t(s.payments, "fake_provider_outage")+`),
			count(*), count(DISTINCT r.id),
			count(DISTINCT r.id) FILTER (WHERE r.state = 'completed' AND o.status = 'confirmed'),
			count(DISTINCT r.id) FILTER (WHERE r.state = 'compensated' AND o.status = 'cancelled' AND o.reason LIKE '%declined%'),
			count(*) FILTER (WHERE r.resent_at IS NULL OR r.resent_at < r.at + $1 * interval '1 microsecond'),
			coalesce(extract(epoch FROM min(r.resent_at - r.at)), 0)
		FROM r JOIN `+t(s.orders, "orders")+` o ON o.id::text = r.id`, o.retryAfter.Microseconds()).
		Scan(&refused, &retries, &retried, &completed, &declined, &early, &firstResend)
	if err != nil {
		return row{}, fmt.Errorf("retry-later query: %w", err)
	}
	return row{"charges retried later (provider unavailable), all settled",
		fmt.Sprintf("%d outages of %s: %d refused, %d retries on %d orders, re-sent ≥ %s later (%d sooner, first %.2fs); %d/%d settled: %d confirmed, %d declined",
			s.outages.Load(), o.outage, refused, retries, retried, o.retryAfter, early, firstResend, completed+declined, retried, completed, declined),
		(o.outage == 0 || retries > 0) && refused >= retries && early == 0 && completed+declined == retried}, nil
}

// report prints the table and says whether every row holds.
func report(rows []row, took time.Duration) bool {
	fmt.Printf("\nInvariants after %.1fs:\n\n", took.Seconds())
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  CHECK\tVALUE\tOK")
	ok := true
	for _, r := range rows {
		mark := "✓"
		if !r.ok {
			mark, ok = "✗ FAILED", false
		}
		if r.value == "" {
			mark = ""
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\n", r.name, r.value, mark)
	}
	_ = tw.Flush()
	if ok {
		fmt.Println("\nEvery order ran exactly once, paid at most once, and every duplicate was absorbed.")
	} else {
		fmt.Println("\nAt least one invariant failed.")
	}
	return ok
}
