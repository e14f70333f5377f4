package migrations_test

import (
	"context"
	"testing"

	"github.com/onceflow/onceflow/internal/testdb"
)

// Step 0010 creates the bookkeeping table of `onceflow migrate from-forwarder`.
func TestForwarderMoveTable(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	var n int
	if err := db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM information_schema.columns
		WHERE table_schema = $1 AND table_name = 'forwarder_move'
		AND column_name IN ('source', 'start_transaction_id', 'start_offset', 'moved', 'first_event_id', 'last_event_id')`, db.Schema).Scan(&n); err != nil || n != 6 {
		t.Fatalf("forwarder_move has %d of the 6 columns (%v)", n, err)
	}
}
