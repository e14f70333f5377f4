package inbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgsql"
)

// IsUniqueViolation reports whether err is a PostgreSQL unique violation (SQLSTATE 23505,
// a *pgconn.PgError) on the named constraint; with constraint "" any unique violation counts.
//
// It is the second barrier for effects that must never happen twice, such as recording a
// payment: the inbox stops redeliveries of one message, and a business key such as
// UNIQUE (payment_provider, external_payment_id) stops two different messages (a webhook
// sent twice by the provider, with two event ids) from booking the same payment.
func IsUniqueViolation(err error, constraint string) bool {
	return pgsql.IsUniqueViolation(err, constraint)
}

// InsertOnce runs insert inside a savepoint of tx and reports whether it inserted. When insert
// fails with a unique violation on constraint, the savepoint is rolled back and InsertOnce
// returns (false, nil): the row already exists and the caller reads it instead. The savepoint
// matters because a failed statement aborts the whole transaction — without it the inbox
// transaction, with its dedup row, could not commit. Any other error is returned unchanged
// (after rolling the savepoint back), and the caller should fail the message.
//
//	inserted, err := inbox.InsertOnce(ctx, tx, "payment_provider_external_id_key", func(tx pgx.Tx) error {
//		_, err := tx.Exec(ctx, `INSERT INTO payment (provider, external_id, amount) VALUES ($1, $2, $3)`, p, id, amt)
//		return err
//	})
//	if err == nil && !inserted {
//		err = tx.QueryRow(ctx, `SELECT id FROM payment WHERE provider = $1 AND external_id = $2`, p, id).Scan(&paymentID)
//	}
//
// constraint must name the constraint (or unique index); "" is refused, because catching
// every unique violation would hide real bugs.
func InsertOnce(ctx context.Context, tx pgx.Tx, constraint string, insert func(tx pgx.Tx) error) (inserted bool, err error) {
	if constraint == "" {
		return false, errors.New("inbox: InsertOnce needs the name of the unique constraint to tolerate (see \\d table in psql)")
	}
	sp, err := tx.Begin(ctx) // a pgx.Tx's Begin creates a savepoint
	if err != nil {
		return false, fmt.Errorf("inbox: InsertOnce: create savepoint: %w", err)
	}
	if err := insert(sp); err != nil {
		if rbErr := sp.Rollback(ctx); rbErr != nil {
			return false, errors.Join(err, fmt.Errorf("inbox: InsertOnce: roll back to savepoint: %w", rbErr))
		}
		if IsUniqueViolation(err, constraint) {
			return false, nil
		}
		return false, err
	}
	if err := sp.Commit(ctx); err != nil { // releases the savepoint
		return false, fmt.Errorf("inbox: InsertOnce: release savepoint: %w", err)
	}
	return true, nil
}
