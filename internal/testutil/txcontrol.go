package testutil

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// TxControlCase is SQL that ends (or restarts) a managed transaction, sent one way (Via: exec,
// query, queryrow, batch, prepare, savepoint; or conn, around the view). Both middlewares' tests
// run every case, so the inbox and the HTTP middleware are held to one list.
type TxControlCase struct{ Name, Via, SQL string }

// EndingStatements end (or restart) the managed transaction, each through one way of sending
// SQL on the handler's view.
var EndingStatements = []TxControlCase{
	{"COMMIT", "exec", "COMMIT"},
	{"commit lower case", "exec", "commit"},
	{"ROLLBACK", "exec", "ROLLBACK"},
	{"END", "exec", "end"},
	{"END TRANSACTION", "exec", "END TRANSACTION"},
	{"ABORT", "exec", "ABORT"},
	{"COMMIT AND CHAIN", "exec", "COMMIT AND CHAIN"},
	{"ROLLBACK AND CHAIN", "exec", "rollback and chain"},
	{"COMMIT WORK", "exec", "COMMIT WORK"},
	{"BEGIN", "exec", "BEGIN"},
	{"START TRANSACTION", "exec", "START TRANSACTION ISOLATION LEVEL SERIALIZABLE"},
	{"PREPARE TRANSACTION", "exec", "PREPARE TRANSACTION 'onceflow-test'"},
	{"leading comments", "exec", "/* a /* nested */ comment */ -- and a line\n\t Commit"},
	{"second statement", "exec", "SELECT 1; COMMIT"},
	{"between two", "exec", "SELECT ';'; commit; SELECT 2"},
	{"after a string with a semicolon", "exec", "SELECT 'a;b', $$;x$$ ; END"},
	{"Query", "query", "COMMIT"},
	{"QueryRow", "queryrow", "ROLLBACK"},
	{"SendBatch", "batch", "COMMIT"},
	{"Prepare", "prepare", "COMMIT"},
	{"in a savepoint", "savepoint", "COMMIT"},
}

// SendVia sends sql on tx the way via names.
func SendVia(ctx context.Context, tx pgx.Tx, via, sql string) error {
	switch via {
	case "exec":
		_, err := tx.Exec(ctx, sql)
		return err
	case "query":
		rows, err := tx.Query(ctx, sql)
		if err != nil {
			return err
		}
		rows.Close()
		return rows.Err()
	case "queryrow":
		return tx.QueryRow(ctx, sql).Scan()
	case "batch":
		b := &pgx.Batch{}
		b.Queue(sql)
		return tx.SendBatch(ctx, b).Close()
	case "prepare":
		if _, err := tx.Prepare(ctx, "ending", sql); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "ending")
		return err
	case "savepoint":
		return pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
			_, err := sp.Exec(ctx, sql)
			return err
		})
	case "conn": // around the view, on the connection itself
		_, err := tx.Conn().Exec(ctx, sql)
		return err
	}
	panic("unknown way " + via)
}
