package engine

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
)

// GiveUpTx records msg as given up, in tx: its dedup row (key; "" when it has none) and its
// inbox_poison row, so the consumer moves past it exactly once, a redelivery is skipped, and
// `onceflow inbox poison` shows it with its error. The row keeps the message's subscribe topic
// (message.SubscribeTopicFromCtx), which scopes a replay to the consumer of that topic.
//
// settled reports whether msg was given up now. A message whose dedup key is recorded already
// (another delivery of it committed meanwhile, or the last attempt's commit went through as
// its connection dropped) is not: it gets no poison row, and settled is false.
func (r *Runner) GiveUpTx(ctx context.Context, tx pgx.Tx, msg *message.Message, key string, g GiveUp) (settled bool, err error) {
	if key != "" {
		claimed, err := r.ClaimTx(ctx, tx, key)
		if err != nil {
			return false, err
		}
		if !claimed[0] {
			return false, nil // another delivery of it committed meanwhile: nothing to give up
		}
	}
	return true, r.RecordPoisonTx(ctx, tx, msg, key, g)
}

// RecordPoisonTx writes msg's inbox_poison row in tx, for a message whose dedup key (key; ""
// when it has none) is recorded already: one the retry lane parked (its key was claimed when
// it was parked) and now gives up. GiveUpTx is the claim and this.
func (r *Runner) RecordPoisonTx(ctx context.Context, tx pgx.Tx, msg *message.Message, key string, g GiveUp) error {
	var dedupKey *string
	if key != "" {
		dedupKey = &key
	}
	md, err := json.Marshal(msg.Metadata)
	if err != nil {
		return fmt.Errorf("%s: encode the metadata of poison message %q: %w", r.cfg.What, msg.UUID, err)
	}
	reason := "unknown error"
	if g.Err != nil {
		reason = g.Err.Error()
	}
	payload := msg.Payload
	if payload == nil {
		payload = []byte{}
	}
	var noReplay *string
	if g.NoReplay != "" {
		noReplay = &g.NoReplay
	}
	if _, err := tx.Exec(ctx, r.sql.poison, r.cfg.Consumer, dedupKey, msg.UUID, g.Source, md, payload, g.Attempts, reason,
		g.Handler, g.PublishTopic, noReplay, message.SubscribeTopicFromCtx(msg.Context())); err != nil {
		return fmt.Errorf("%s: record poison message %q: %w", r.cfg.What, msg.UUID, err)
	}
	return nil
}

// LogGiveUp logs a message recorded as given up, once its transaction committed.
func (r *Runner) LogGiveUp(msg *message.Message, g GiveUp) {
	r.cfg.Logger.Error("onceflow: message given up; recorded as poison and skipped (`onceflow inbox poison` lists it; once the cause is fixed, `onceflow inbox poison replay` re-drives it through this consumer)",
		"consumer", r.cfg.Consumer, "message_uuid", msg.UUID, "source", g.Source, "attempts", g.Attempts, "err", g.Err)
}
