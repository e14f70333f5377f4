package hatest

import (
	"context"
	"testing"
	"time"
)

// drainBound is the bound the synchronous failover test asserts: from the standby's
// promotion until the outbox is empty, every event on the new primary is in Kafka, every
// effect applied and every saga finished. The load goes on for a while after the promotion
// (afterWrites), so this includes publishing that load. Measured figures: see the test log
// (go test -race -run TestFailover -v ./internal/hatest/), and the report of issue 36.
const drainBound = 30 * time.Second

// asyncEffectWait is how long the asynchronous tests wait for effects after the outbox
// drained: the effects an asynchronous failover lost are not coming back (the consumer's
// offsets are committed in Kafka), and the rest arrive within a second.
const asyncEffectWait = 5 * time.Second

// afterWrites is how many writes the writers make on the new primary before the load stops.
const afterWrites = 300

// failover runs one failover under load and measures what it cost:
//   - writers (4, 8 keys each), saga starts, the relay, the effect consumer, the participants
//     and the orchestrator run on the multi-host URL;
//   - after 300 acknowledged writes and 20 saga starts, the primary is killed
//     (pg_ctl stop -m immediate) and the standby promoted (pg_ctl promote); with lag > 0 the
//     standby is stopped lag before the kill (the load goes on), so it lacks that much of the
//     primary's history: an asynchronous standby that lagged;
//   - the load goes on until afterWrites writes on the new primary, then stops, and the
//     figures are read from the new primary and from Kafka.
//
// After the outbox drained and the sagas finished, it waits up to drainBound for every event
// of the new primary to have its effect; after an asynchronous failover some never will (see
// LedgerWithoutEffect), so it waits only asyncEffectWait there.
func failover(t *testing.T, sync bool, lag, stepTimeout time.Duration) figures {
	ctx := context.Background()
	w := newWorld(t, sync, stepTimeout)
	w.startComponents()
	w.startLoad(4, 8)
	if _, ok := waitFor(2*time.Minute, func() bool { n, s := w.counts(); return n >= 300 && s >= 20 }); !ok {
		n, s := w.counts()
		t.Fatalf("the load did not start: %d writes, %d saga starts", n, s)
	}
	if lag > 0 {
		if err := w.pair.Standby.Halt(ctx); err != nil {
			t.Fatal(err)
		}
		time.Sleep(lag) // the load goes on without the standby: the history it will lack
	}
	killed := time.Now()
	if err := w.pair.Primary.Halt(ctx); err != nil {
		t.Fatal(err)
	}
	if lag > 0 {
		if err := w.pair.Standby.Resume(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.pair.Standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	w.promoted()
	promoted := time.Now()
	atPromotion, _ := w.counts()
	t.Logf("primary killed; standby promoted %s later", promoted.Sub(killed).Round(time.Millisecond))
	if _, ok := waitFor(2*time.Minute, func() bool { n, _ := w.counts(); return n >= atPromotion+afterWrites }); !ok {
		t.Fatalf("the writers made no progress on the new primary")
	}
	w.stopLoad()
	stopped := time.Now()

	var f figures
	outbox := `SELECT count(*) FROM ` + w.db.Table("outbox")
	if _, ok := waitFor(drainBound, func() bool { return w.count(outbox) == 0 }); ok {
		f.DrainAfterPromote, f.DrainAfterLoad = time.Since(promoted), time.Since(stopped)
	}
	sagasOpen := `SELECT count(*) FROM ` + w.db.Table("saga") + ` WHERE state NOT IN ('completed', 'compensated')`
	if _, ok := waitFor(drainBound, func() bool { return w.count(sagasOpen) == 0 }); ok {
		f.SagasFinishedAfterPromote = time.Since(promoted)
	}
	effectsMissing := `SELECT count(*) FROM ` + w.db.Table("ledger") + ` l WHERE NOT EXISTS (SELECT FROM ` + w.db.Table("effect") + ` e WHERE e.event_id = l.event_id)`
	effectWait := drainBound
	if !sync {
		effectWait = asyncEffectWait
	}
	if _, ok := waitFor(effectWait, func() bool { return w.count(effectsMissing) == 0 }); ok {
		f.EffectsAfterPromote = time.Since(promoted)
	}
	w.stop()
	recs := w.readTopic()
	t.Logf("load stopped %s after the promotion", stopped.Sub(promoted).Round(time.Millisecond))

	// What the new primary has.
	ledger := w.queryIDs(`SELECT event_id::text FROM ` + w.db.Table("ledger"))
	effects := map[string]int{}
	rows, err := w.reads.Query(ctx, `SELECT event_id::text, count(*) FROM `+w.db.Table("effect")+` GROUP BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			t.Fatal(err)
		}
		effects[id] = n
	}
	rows.Close()
	sagasThere := w.queryIDs(`SELECT id FROM ` + w.db.Table("saga"))
	f.SagasUnfinished = w.count(sagasOpen)
	f.SagaDoubleEffects = w.count(`SELECT count(*) FROM (SELECT FROM ` + w.db.Table("saga_effect") + ` GROUP BY saga, step, phase HAVING count(*) > 1) d`)
	f.OutboxLeft = w.count(outbox)

	// What Kafka has.
	inKafka := map[string]bool{}
	type keyState struct {
		max   int
		seqID map[int]string
	}
	keys := map[string]*keyState{}
	for _, r := range recs {
		if inKafka[r.EventID] {
			f.Duplicates++
			continue
		}
		inKafka[r.EventID] = true
		if !ledger[r.EventID] {
			f.Invented++
			if effects[r.EventID] > 0 {
				f.EffectsOfInvented++
			}
		}
		k := keys[r.Key]
		if k == nil {
			k = &keyState{seqID: map[int]string{}}
			keys[r.Key] = k
		}
		switch {
		case k.seqID[r.Seq] != "":
			f.SeqReused++ // the key's seq again, with another event id: history the new primary lost
		case r.Seq < k.max:
			f.OrderBroken++
		}
		k.seqID[r.Seq] = r.EventID
		k.max = max(k.max, r.Seq)
	}
	for id := range ledger {
		if !inKafka[id] {
			f.MissingFromKafka++
		}
		if effects[id] == 0 {
			f.LedgerWithoutEffect++
		}
	}
	for _, n := range effects {
		if n > 1 {
			f.DoubleEffects++
		}
	}
	w.mu.Lock()
	for _, wr := range w.writes {
		if wr.Err == nil {
			f.Acked++
			if !ledger[wr.EventID] {
				f.LostAcked++
				if inKafka[wr.EventID] {
					f.LostAckedPublished++
				}
			}
			continue
		}
		f.Unknown++
		if ledger[wr.EventID] {
			f.UnknownCommitted++
		}
	}
	for _, s := range w.sagas {
		if s.Err == nil {
			f.SagasAcked++
			if !sagasThere[s.ID] {
				f.SagasLost++
			}
		}
	}
	w.mu.Unlock()
	t.Logf("%s figures: %s", t.Name(), f)
	return f
}

// TestFailoverSynchronous: with a synchronous standby (synchronous_standby_names,
// synchronous_commit on), a failover under load loses nothing, invents nothing, doubles no
// effect, keeps every key's order, finishes every saga, and the outbox drains within
// drainBound of the promotion.
func TestFailoverSynchronous(t *testing.T) {
	t.Parallel()
	f := failover(t, true, 0, 0)
	for _, c := range []struct {
		what string
		n    int
	}{
		{"acknowledged writes missing on the new primary", f.LostAcked},
		{"events on the new primary never published", f.MissingFromKafka},
		{"events in Kafka the new primary does not have (invented)", f.Invented},
		{"events with more than one effect", f.DoubleEffects},
		{"events on the new primary without their effect", f.LedgerWithoutEffect},
		{"Kafka records reusing a key's seq with another id", f.SeqReused},
		{"Kafka records going backwards in their key's order", f.OrderBroken},
		{"acknowledged saga starts missing on the new primary", f.SagasLost},
		{"sagas not finished", f.SagasUnfinished},
		{"saga steps applied more than once", f.SagaDoubleEffects},
		{"rows left in the outbox", f.OutboxLeft},
	} {
		if c.n != 0 {
			t.Errorf("%s: %d, want 0", c.what, c.n)
		}
	}
	if f.DrainAfterPromote == 0 || f.SagasFinishedAfterPromote == 0 || f.EffectsAfterPromote == 0 {
		t.Errorf("not drained within %s of the promotion", drainBound)
	}
	if f.Acked == 0 {
		t.Error("no write was acknowledged")
	}
}

// TestFailoverAsynchronous: with an asynchronous standby, a failover loses the primary's
// acknowledged commits the standby had not received. The test measures what that costs
// (logged as figures; see the report of issue 36) and asserts what onceflow still
// guarantees: no effect applied twice (the dedup row and the effect commit together, so they
// are lost together), every event the new primary has reaches Kafka and the outbox drains (the
// relay notices it is on another server and reads the outbox again, TestRelayFollowsA
// FailoverToAStandbyThatLagged), and no key's order goes backwards other than where the new
// primary reissued a lost sequence number.
//
// "streaming": the standby streams until the kill (on one machine it lags by milliseconds).
// "lagged 1s": the standby is stopped a second before the kill, as one that fell behind.
// The saga steps have a 2s timeout, which re-sends a command whose reply the new primary
// lost.
func TestFailoverAsynchronous(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		lag  time.Duration
	}{{"streaming", 0}, {"lagged 1s", time.Second}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			f := failover(t, false, c.lag, 2*time.Second)
			for _, c := range []struct {
				what string
				n    int
			}{
				{"events with more than one effect", f.DoubleEffects},
				{"events on the new primary never published", f.MissingFromKafka},
				{"Kafka records going backwards in their key's order", f.OrderBroken},
				{"rows left in the outbox", f.OutboxLeft},
				{"sagas not finished", f.SagasUnfinished},
			} {
				if c.n != 0 {
					t.Errorf("%s: %d, want 0", c.what, c.n)
				}
			}
		})
	}
}
