package inbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/inbox"
	"github.com/onceflow/onceflow/outbox"
)

// The second barrier for money: the provider sends the same payment twice as two different
// events. The inbox cannot tell them apart, the business key can: the second insert hits the
// unique constraint, InsertOnce turns that into "already there", the handler reads the
// existing row, and its inbox transaction still commits.
func TestInsertOnceFallsBackToExistingRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, nil)
	if _, err := f.db.Pool.Exec(ctx, `CREATE TABLE `+f.db.Table("payment")+` (
		id bigserial PRIMARY KEY, provider text NOT NULL, external_id text NOT NULL, amount int NOT NULL CHECK (amount > 0),
		CONSTRAINT payment_provider_external_id_key UNIQUE (provider, external_id))`); err != nil {
		t.Fatal(err)
	}
	var seenIDs []int64
	h := f.ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx := outbox.MustTx(msg.Context())
		amount := 100
		if string(msg.Payload) == "bad amount" {
			amount = -1
		}
		inserted, err := inbox.InsertOnce(msg.Context(), tx, "payment_provider_external_id_key", func(tx pgx.Tx) error {
			_, err := tx.Exec(msg.Context(), `INSERT INTO `+f.db.Table("payment")+` (provider, external_id, amount) VALUES ('stripe', 'ch_1', $1)`, amount)
			return err
		})
		if err != nil {
			return nil, err
		}
		var id int64
		if err := tx.QueryRow(msg.Context(), `SELECT id FROM `+f.db.Table("payment")+` WHERE provider = 'stripe' AND external_id = 'ch_1'`).Scan(&id); err != nil {
			return nil, err
		}
		seenIDs = append(seenIDs, id)
		if inserted {
			return nil, f.applyEffect(msg, "booked")
		}
		return nil, f.applyEffect(msg, "already booked")
	})
	first, second := outbox.NewMessage([]byte("webhook")), outbox.NewMessage([]byte("webhook again"))
	for _, m := range []*message.Message{first, second} {
		if _, err := h(m); err != nil {
			t.Fatal(err)
		}
	}
	if f.count(`SELECT count(*) FROM `+f.db.Table("payment")) != 1 || len(seenIDs) != 2 || seenIDs[0] != seenIDs[1] {
		t.Fatalf("payments %d, ids %v", f.count(`SELECT count(*) FROM `+f.db.Table("payment")), seenIDs)
	}
	if f.count(`SELECT count(*) FROM `+f.db.Table("effect")+` WHERE note = 'already booked'`) != 1 || f.dedupRows() != 2 {
		t.Fatal("the second webhook's transaction did not commit after the fallback")
	}

	// Any other error is returned, not swallowed; a constraint must be named.
	if _, err := h(outbox.NewMessage([]byte("bad amount"))); err == nil || inbox.IsUniqueViolation(err, "") {
		t.Fatalf("check violation: %v", err)
	}
	err := pgx.BeginFunc(ctx, f.db.Pool, func(tx pgx.Tx) error {
		_, err := inbox.InsertOnce(ctx, tx, "other_constraint", func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+f.db.Table("payment")+` (provider, external_id, amount) VALUES ('stripe', 'ch_1', 5)`)
			return err
		})
		return err
	})
	if !inbox.IsUniqueViolation(err, "payment_provider_external_id_key") || inbox.IsUniqueViolation(err, "other_constraint") {
		t.Fatalf("violation of another constraint: %v", err)
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23505" {
		t.Fatalf("err = %v, want the *pgconn.PgError", err)
	}
	_, err = inbox.InsertOnce(ctx, nil, "", nil)
	if err == nil || !strings.Contains(err.Error(), "needs the name") {
		t.Fatalf("empty constraint: %v", err)
	}
}
