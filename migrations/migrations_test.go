package migrations_test

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/testdb"
	"github.com/onceflow/onceflow/internal/testutil"
	"github.com/onceflow/onceflow/migrations"
)

func TestMain(m *testing.M) { testdb.Main(m) }

func TestUpTwiceIsNoop(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewEmpty(t)
	opts := migrations.Options{Schema: db.Schema}
	first, err := migrations.Up(ctx, db.Pool, opts)
	if err != nil {
		t.Fatal(err)
	}
	if len(first) != len(migrations.All()) || len(first) == 0 {
		t.Fatalf("first run applied %d of %d", len(first), len(migrations.All()))
	}
	second, err := migrations.Up(ctx, db.Pool, opts)
	if err != nil {
		t.Fatal(err)
	}
	if len(second) != 0 {
		t.Fatalf("second run applied %d steps, want 0", len(second))
	}
	statuses, err := migrations.Statuses(ctx, db.Pool, opts)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range statuses {
		if s.AppliedAt == nil {
			t.Fatalf("step %d pending after Up", s.Version)
		}
	}
	// Step 0011: the saga list's keyset indexes; step 0013: the inbox's replay requests.
	for _, table := range []string{"outbox", "processed_event", "idempotency_record", "saga_created_idx", "saga_state_created_idx", "inbox_poison_replay_idx"} {
		var ok bool
		if err := db.Pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", db.Schema+"."+table).Scan(&ok); err != nil || !ok {
			t.Fatalf("table %s missing (err %v)", table, err)
		}
	}
}

func TestConcurrentUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewEmpty(t)
	opts := migrations.Options{Schema: db.Schema}
	const runners = 4
	var wg sync.WaitGroup
	applied := make([]int, runners)
	errs := make([]error, runners)
	for i := range runners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ms, err := migrations.Up(ctx, db.Pool, opts)
			applied[i], errs[i] = len(ms), err
		}()
	}
	wg.Wait()
	total := 0
	for i := range runners {
		if errs[i] != nil {
			t.Fatalf("runner %d: %v", i, errs[i])
		}
		total += applied[i]
	}
	if total != len(migrations.All()) {
		t.Fatalf("runners applied %d steps in total, want each of %d once", total, len(migrations.All()))
	}
	var rows int
	if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM "+db.Schema+".schema_migration").Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != len(migrations.All()) {
		t.Fatalf("version table has %d rows", rows)
	}
}

func TestBadSchemaRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewEmpty(t)
	for _, bad := range []string{"Onceflow", "1abc", "a-b", `x"; DROP SCHEMA public; --`, strings.Repeat("a", 64), "has space"} {
		_, err := migrations.Up(ctx, db.Pool, migrations.Options{Schema: bad})
		if err == nil || !strings.Contains(err.Error(), "invalid schema name") {
			t.Errorf("schema %q: err = %v", bad, err)
		}
		if _, err := migrations.Print(migrations.Options{Schema: bad}); err == nil {
			t.Errorf("Print accepted schema %q", bad)
		}
	}
	var n int
	if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_namespace WHERE nspname NOT LIKE 'pg_%' AND nspname NOT IN ('public','information_schema') AND nspname NOT LIKE 't\\_%'").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("%d unexpected schemas created", n)
	}
}

func TestPrintAppliesCleanly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewEmpty(t)
	sql, err := migrations.Print(migrations.Options{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(sql, "{{schema}}") {
		t.Fatal("printed SQL still has the schema token")
	}
	if _, err := db.Pool.Exec(ctx, sql); err != nil {
		t.Fatalf("printed SQL fails: %v", err)
	}
	// A later Up sees the printed steps as applied.
	applied, err := migrations.Up(ctx, db.Pool, migrations.Options{Schema: db.Schema})
	if err != nil || len(applied) != 0 {
		t.Fatalf("Up after Print applied %d (err %v), want 0", len(applied), err)
	}
}

// notMigrated asserts that err is a *NotMigratedError listing exactly the wanted versions as
// pending, and that its message names them and the command to run.
func notMigrated(t *testing.T, err error, schema string, pending ...int) *migrations.NotMigratedError {
	t.Helper()
	var nm *migrations.NotMigratedError
	if !errors.As(err, &nm) || !errors.Is(err, migrations.ErrNotMigrated) {
		t.Fatalf("err = %v, want a *NotMigratedError", err)
	}
	var got []int
	for _, m := range nm.Pending {
		got = append(got, m.Version)
	}
	if len(got) != len(pending) {
		t.Fatalf("pending %v, want %v", got, pending)
	}
	for i := range got {
		if got[i] != pending[i] {
			t.Fatalf("pending %v, want %v", got, pending)
		}
	}
	msg := err.Error()
	for _, m := range nm.Pending {
		if want := m.Name; !strings.Contains(msg, want) {
			t.Errorf("message lacks step %q: %s", want, msg)
		}
	}
	if want := "onceflow migrate up --schema " + schema; !strings.Contains(msg, want) {
		t.Errorf("message lacks %q: %s", want, msg)
	}
	return nm
}

func allVersions() []int {
	var vs []int
	for _, m := range migrations.All() {
		vs = append(vs, m.Version)
	}
	return vs
}

func TestValidate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewEmpty(t)
	opts := migrations.Options{Schema: db.Schema}

	nm := notMigrated(t, migrations.Validate(ctx, db.Pool, opts), db.Schema, allVersions()...)
	if !nm.NeverMigrated || !strings.Contains(nm.Error(), "never been migrated") {
		t.Errorf("fresh schema not reported as never migrated: %v", nm)
	}
	if _, err := migrations.Up(ctx, db.Pool, opts); err != nil {
		t.Fatal(err)
	}
	if err := migrations.Validate(ctx, db.Pool, opts); err != nil {
		t.Fatalf("after Up: %v", err)
	}

	// A step missing in the middle is named; the others are not.
	last := migrations.All()[len(migrations.All())-1]
	if _, err := db.Pool.Exec(ctx, "DELETE FROM "+db.Schema+".schema_migration WHERE version = $1", last.Version); err != nil {
		t.Fatal(err)
	}
	nm = notMigrated(t, migrations.Validate(ctx, db.Pool, opts), db.Schema, last.Version)
	if nm.NeverMigrated {
		t.Error("a partly migrated schema reported as never migrated")
	}
	if _, err := migrations.Up(ctx, db.Pool, opts); err != nil {
		t.Fatal(err)
	}

	if err := migrations.Validate(ctx, db.Pool, migrations.Options{Schema: "Bad"}); err == nil || errors.Is(err, migrations.ErrNotMigrated) {
		t.Errorf("bad schema name: err = %v, want a validation error", err)
	}
}

// TestValidateNewerSchema: steps a newer onceflow applied are a warning, not an error (a rolling
// deploy migrates while old processes still run); pending steps still are an error.
func TestValidateNewerSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewEmpty(t)
	var logs testutil.SyncBuffer
	opts := migrations.Options{Schema: db.Schema, Logger: slog.New(slog.NewTextHandler(&logs, nil))}
	if _, err := migrations.Up(ctx, db.Pool, opts); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, "INSERT INTO "+db.Schema+".schema_migration (version, name) VALUES (9999, 'from_the_future')"); err != nil {
		t.Fatal(err)
	}
	if err := migrations.Validate(ctx, db.Pool, opts); err != nil {
		t.Fatalf("newer schema: %v, want nil and a warning", err)
	}
	if out := logs.String(); !strings.Contains(out, "level=WARN") || !strings.Contains(out, "from_the_future") || !strings.Contains(out, "newer onceflow") {
		t.Errorf("no warning about the newer step:\n%s", out)
	}
	st, err := migrations.Statuses(ctx, db.Pool, opts)
	if err != nil {
		t.Fatal(err)
	}
	if last := st[len(st)-1]; !last.Unknown || last.Version != 9999 || last.Name != "from_the_future" || last.AppliedAt == nil {
		t.Fatalf("Statuses' last entry = %+v, want the unknown step 9999", last)
	}
	for _, s := range st[:len(st)-1] {
		if s.Unknown {
			t.Fatalf("known step %d marked unknown", s.Version)
		}
	}
	// Up leaves the unknown step alone and applies nothing.
	if applied, err := migrations.Up(ctx, db.Pool, opts); err != nil || len(applied) != 0 {
		t.Fatalf("Up on a newer schema applied %d (err %v), want 0", len(applied), err)
	}

	first := migrations.All()[0]
	if _, err := db.Pool.Exec(ctx, "DELETE FROM "+db.Schema+".schema_migration WHERE version = $1", first.Version); err != nil {
		t.Fatal(err)
	}
	nm := notMigrated(t, migrations.Validate(ctx, db.Pool, opts), db.Schema, first.Version)
	if len(nm.Unknown) != 1 || !strings.Contains(nm.Error(), "9999_from_the_future") || !strings.Contains(nm.Error(), "newer onceflow") {
		t.Errorf("error does not mention the newer step: %v", nm)
	}
}

func TestUpTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewEmpty(t)
	opts := migrations.Options{Schema: db.Schema}

	// Rolled back: nothing applied, not even the schema.
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	applied, err := migrations.UpTx(ctx, tx, opts)
	if err != nil || len(applied) != len(migrations.All()) {
		t.Fatalf("UpTx applied %d of %d (err %v)", len(applied), len(migrations.All()), err)
	}
	if err := migrations.Validate(ctx, tx, opts); err != nil {
		t.Fatalf("Validate in the migrating transaction: %v", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	notMigrated(t, migrations.Validate(ctx, db.Pool, opts), db.Schema, allVersions()...)

	// Committed: every step applied, and a second UpTx has nothing to do.
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		applied, err = migrations.UpTx(ctx, tx, opts)
		return err
	})
	if err != nil || len(applied) != len(migrations.All()) {
		t.Fatalf("UpTx applied %d of %d (err %v)", len(applied), len(migrations.All()), err)
	}
	if err := migrations.Validate(ctx, db.Pool, opts); err != nil {
		t.Fatalf("after UpTx and commit: %v", err)
	}
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		applied, err = migrations.UpTx(ctx, tx, opts)
		return err
	})
	if err != nil || len(applied) != 0 {
		t.Fatalf("second UpTx applied %d (err %v), want 0", len(applied), err)
	}
}

func TestUpTxRefusesStricterIsolation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewEmpty(t)
	for _, iso := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
		tx, err := db.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
		if err != nil {
			t.Fatal(err)
		}
		_, err = migrations.UpTx(ctx, tx, migrations.Options{Schema: db.Schema})
		if err == nil || !strings.Contains(err.Error(), "READ COMMITTED") {
			t.Errorf("%s: err = %v, want a refusal naming READ COMMITTED", iso, err)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// TestConcurrentUpTx: while one transaction has migrated and not committed, a second UpTx
// waits on the lock; once the first commits, the second finds nothing to do. If the first
// rolls back instead, the second applies every step.
func TestConcurrentUpTx(t *testing.T) {
	t.Parallel()
	for _, commitFirst := range []bool{true, false} {
		ctx := context.Background()
		db := testdb.NewEmpty(t)
		opts := migrations.Options{Schema: db.Schema}
		first, err := db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if applied, err := migrations.UpTx(ctx, first, opts); err != nil || len(applied) != len(migrations.All()) {
			t.Fatalf("first UpTx applied %d (err %v)", len(applied), err)
		}
		second, err := db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var pid int
		if err := second.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			t.Fatal(err)
		}
		type result struct {
			applied []migrations.Migration
			err     error
		}
		done := make(chan result, 1)
		go func() {
			applied, err := migrations.UpTx(ctx, second, opts)
			done <- result{applied, err}
		}()
		// Wait until the second transaction is blocked on the advisory lock.
		deadline := time.Now().Add(30 * time.Second)
		for {
			var waiting bool
			if err := db.Pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = $1 AND locktype = 'advisory' AND NOT granted)", pid).Scan(&waiting); err != nil {
				t.Fatal(err)
			}
			if waiting {
				break
			}
			select {
			case r := <-done:
				t.Fatalf("second UpTx returned while the first held the lock: applied %d, err %v", len(r.applied), r.err)
			default:
			}
			if time.Now().After(deadline) {
				t.Fatal("second UpTx never waited for the lock")
			}
			time.Sleep(5 * time.Millisecond)
		}
		want := 0
		if commitFirst {
			err = first.Commit(ctx)
		} else {
			err, want = first.Rollback(ctx), len(migrations.All())
		}
		if err != nil {
			t.Fatal(err)
		}
		r := <-done
		if r.err != nil || len(r.applied) != want {
			t.Fatalf("commitFirst=%t: second UpTx applied %d (err %v), want %d", commitFirst, len(r.applied), r.err, want)
		}
		if err := second.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if err := migrations.Validate(ctx, db.Pool, opts); err != nil {
			t.Fatal(err)
		}
	}
}

// TestUpWaitsForUpTx: Up and UpTx share the lock, so Up waits for an open migrating
// transaction and then applies nothing.
func TestUpWaitsForUpTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewEmpty(t)
	opts := migrations.Options{Schema: db.Schema}
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := migrations.UpTx(ctx, tx, opts); err != nil {
		t.Fatal(err)
	}
	// Up cannot get the lock while tx is open: it gives up when its context ends.
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	_, err = migrations.Up(short, db.Pool, opts)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Up while a migrating transaction held the lock: err = %v, want it to wait until its deadline", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if applied, err := migrations.Up(ctx, db.Pool, opts); err != nil || len(applied) != 0 {
		t.Fatalf("Up after the commit applied %d (err %v), want 0", len(applied), err)
	}
}

// TestOutboxLateCommitIndex: after step 0012 the outbox carries its primary key and a b-tree
// on tx, which PostgreSQL keeps up to date by itself (the relay's late-commit lookup reads
// it), and neither 0007's BRIN index nor the function that summarized it: nothing is left
// for the relay to maintain under a table-level lock.
func TestOutboxLateCommitIndex(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewEmpty(t)
	if _, err := migrations.Up(ctx, db.Pool, migrations.Options{Schema: db.Schema}); err != nil {
		t.Fatal(err)
	}
	rows, err := db.Pool.Query(ctx, `SELECT c.relname, am.amname || ' ' || pg_get_indexdef(i.indexrelid) FROM pg_index i
		JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am am ON am.oid = c.relam
		WHERE i.indrelid = $1::regclass ORDER BY 1`, db.Schema+".outbox")
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	var name, def string
	if _, err := pgx.ForEachRow(rows, []any{&name, &def}, func() error { got[name] = def; return nil }); err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || !strings.HasPrefix(got["outbox_pkey"], "btree ") || !strings.HasPrefix(got["outbox_tx_idx"], "btree ") ||
		!strings.HasSuffix(got["outbox_tx_idx"], "(tx)") {
		t.Fatalf("outbox indexes %v, want the primary key and outbox_tx_idx, a b-tree on (tx)", got)
	}
	var fn *string
	if err := db.Pool.QueryRow(ctx, `SELECT to_regprocedure($1)::text`, db.Schema+".outbox_summarize(bigint, bigint)").Scan(&fn); err != nil {
		t.Fatal(err)
	}
	if fn != nil {
		t.Fatalf("outbox_summarize still exists (%s); step 0012 drops it", *fn)
	}
}

// Step 0013 is idempotent, and marks the saga engine's poison rows written before it (a reply:
// saga_outcome; a command: saga_reply_to) as refusing a replay, and no other row.
func TestInboxPoisonReplayStepBackfill(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Table("inbox_poison")+` (consumer, dedup_key, message_uuid, metadata, payload, attempts, error) VALUES
		('orchestrator', 'k1', 'u1', '{"saga_id": "s-1", "saga_outcome": "done"}', 'x', 5, 'e'),
		('svc-charge', 'k2', 'u2', '{"saga_id": "s-2", "saga_reply_to": "replies"}', 'x', 5, 'e'),
		('billing', 'k3', 'u3', '{"k": "v"}', 'x', 5, 'e')`); err != nil {
		t.Fatal(err)
	}
	var step migrations.Migration
	for _, m := range migrations.All() {
		if m.Version == 13 {
			step = m
		}
	}
	if step.Version != 13 {
		t.Fatal("no step 0013")
	}
	for range 2 { // idempotent
		if _, err := db.Pool.Exec(ctx, step.SQL(db.Schema)); err != nil {
			t.Fatal(err)
		}
	}
	rows, err := db.Pool.Query(ctx, `SELECT message_uuid, coalesce(replay_refusal, '') FROM `+db.Table("inbox_poison")+` ORDER BY message_uuid`)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for rows.Next() {
		var u, r string
		if err := rows.Scan(&u, &r); err != nil {
			t.Fatal(err)
		}
		got[u] = r
	}
	if !strings.Contains(got["u1"], "onceflow saga retry s-1") || !strings.Contains(got["u2"], "not valid for its participant") || got["u3"] != "" {
		t.Errorf("refusals after step 0013: %q", got)
	}
}

// Step 0019 adds the saga's command record and the audit trail's transaction as catalog
// changes only — neither table is rewritten (its file stays the same) however many rows it
// holds, and existing rows read NULL — and is idempotent. New audit records get their
// transaction's id.
func TestSagaCommandStepIsCatalogOnly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	exec := func(sql string) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	// As before the step, with rows.
	exec(`ALTER TABLE ` + db.Table("saga") + ` DROP COLUMN command_event, DROP COLUMN command_tx`)
	exec(`ALTER TABLE ` + db.Table("operator_action") + ` DROP COLUMN tx`)
	exec(`INSERT INTO ` + db.Table("saga") + ` (id, name, version, state, data, steps)
		SELECT 's-' || g, 'checkout', 1, 'running', '{}', '[]' FROM generate_series(1, 10000) g`)
	exec(`INSERT INTO ` + db.Table("operator_action") + ` (actor, action) VALUES ('ops', 'outbox replay')`)
	files := func() (saga, audit string) {
		t.Helper()
		if err := db.Pool.QueryRow(ctx, `SELECT pg_relation_filenode($1::regclass)::text, pg_relation_filenode($2::regclass)::text`,
			db.Table("saga"), db.Table("operator_action")).Scan(&saga, &audit); err != nil {
			t.Fatal(err)
		}
		return saga, audit
	}
	sagaFile, auditFile := files()
	var step migrations.Migration
	for _, m := range migrations.All() {
		if m.Version == 19 {
			step = m
		}
	}
	if step.Name != "saga_command_tx" {
		t.Fatalf("step 0019 is %q", step.Name)
	}
	for range 2 { // idempotent
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, step.SQL(db.Schema))
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	if s, a := files(); s != sagaFile || a != auditFile {
		t.Fatalf("step 0019 rewrote a table: saga %s → %s, operator_action %s → %s", sagaFile, s, auditFile, a)
	}
	exec(`INSERT INTO ` + db.Table("operator_action") + ` (actor, action) VALUES ('ops', 'outbox replay')`)
	var recorded, old, fresh int
	if err := db.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+db.Table("saga")+` WHERE command_event IS NOT NULL OR command_tx IS NOT NULL),
		(SELECT count(*) FROM `+db.Table("operator_action")+` WHERE tx IS NULL), (SELECT count(*) FROM `+db.Table("operator_action")+` WHERE tx IS NOT NULL)`).
		Scan(&recorded, &old, &fresh); err != nil {
		t.Fatal(err)
	}
	if recorded != 0 || old != 1 || fresh != 1 {
		t.Fatalf("after step 0019: %d sagas with a record, audit records without and with a transaction %d and %d; want 0, 1, 1", recorded, old, fresh)
	}
}

// The queue tables read from the front of an index are vacuumed by a fixed count of dead rows
// (0023), not by a share of the rows waiting.
func TestQueueTablesVacuumByCount(t *testing.T) {
	ctx := context.Background()
	db := testdb.New(t) // migrated
	for _, table := range []string{"outbox_scheduled", "inbox_parked"} {
		var opts []string
		if err := db.Pool.QueryRow(ctx, `SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = $1::regclass`, db.Schema+"."+table).Scan(&opts); err != nil {
			t.Fatal(err)
		}
		if !slices.Contains(opts, "autovacuum_vacuum_scale_factor=0") || !slices.Contains(opts, "autovacuum_vacuum_threshold=10000") {
			t.Errorf("%s: reloptions %v", table, opts)
		}
	}
}
