package pgsql

import (
	"slices"
	"strings"
	"testing"
)

func TestTxControl(t *testing.T) {
	for _, c := range []struct{ sql, want string }{
		{"COMMIT", "COMMIT"},
		{"commit", "COMMIT"},
		{"  Commit ;", "COMMIT"},
		{"COMMIT AND CHAIN", "COMMIT AND CHAIN"},
		{"COMMIT PREPARED 'x'", "COMMIT PREPARED"},
		{"END", "END"},
		{"end transaction", "END TRANSACTION"},
		{"ABORT", "ABORT"},
		{"ROLLBACK", "ROLLBACK"},
		{"rollback work", "ROLLBACK WORK"},
		{"ROLLBACK AND CHAIN", "ROLLBACK AND CHAIN"},
		{"ROLLBACK PREPARED 'x'", "ROLLBACK PREPARED"},
		{"BEGIN", "BEGIN"},
		{"BEGIN ISOLATION LEVEL SERIALIZABLE", "BEGIN ISOLATION LEVEL"},
		{"START TRANSACTION", "START TRANSACTION"},
		{"PREPARE TRANSACTION 'gid'", "PREPARE TRANSACTION"},
		{"-- a comment\nCOMMIT", "COMMIT"},
		{"/* a /* nested */ comment */COMMIT", "COMMIT"},
		{"SELECT 1; COMMIT", "COMMIT"},
		{"SELECT 1;COMMIT;SELECT 2", "COMMIT"},
		{"SELECT 'a;b'; END", "END"},
		{"SELECT 'it''s;'; END", "END"},
		{`SELECT "a;""b"; END`, "END"},
		{"SELECT $$;$$; END", "END"},
		{"SELECT $x$ ; $y$ ; $x$; END", "END"},
		{"SELECT E'\\';'; END", "END"},
		// With standard_conforming_strings off, 'a\'' is a string "a'"; then COMMIT runs.
		{`SELECT 'a\'' ; COMMIT`, "COMMIT"},
		{"SELECT 1 -- ; COMMIT\n; ABORT", "ABORT"},

		{"", ""},
		{";;", ""},
		{"SELECT 1", ""},
		{"SAVEPOINT s", ""},
		{"RELEASE SAVEPOINT s", ""},
		{"RELEASE s", ""},
		{"ROLLBACK TO SAVEPOINT s", ""},
		{"rollback to s", ""},
		{"ROLLBACK WORK TO s", ""},
		{"ROLLBACK TRANSACTION TO SAVEPOINT s", ""},
		{"SELECT 'COMMIT'", ""},
		{"SELECT 1 AS commit", ""},
		{`SELECT "commit"`, ""},
		{"SELECT $$; COMMIT$$", ""},
		{"SELECT $1::text; SELECT $2", ""},
		{"-- COMMIT", ""},
		{"/* ; COMMIT */ SELECT 1", ""},
		{"SELECT 'a; COMMIT", ""}, // unterminated: the server refuses it
		{"PREPARE stmt AS SELECT 1", ""},
		{"INSERT INTO t (x) VALUES ('end'); UPDATE t SET x = 'begin'", ""},
		{"DO $$BEGIN COMMIT; END$$", ""}, // the server refuses COMMIT inside DO in a transaction block
		{"CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; SELECT CASE WHEN true THEN 1 END; END; SELECT 2", ""},
		{"CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; END; COMMIT", "COMMIT"},
		{"SET LOCAL lock_timeout = '1s'", ""},
		{"e'x'; COMMIT", "COMMIT"},
	} {
		if got := TxControl(c.sql); got != c.want {
			t.Errorf("TxControl(%q) = %q; want %q", c.sql, got, c.want)
		}
	}
}

// FuzzTxControl feeds the scanner arbitrary text: it must not panic or loop, and what it
// reports is always one of the statements it refuses.
func FuzzTxControl(f *testing.F) {
	for _, s := range []string{"COMMIT", "SELECT 'x'; END", "SELECT $a$ $a$; ROLLBACK TO s", "/* /* */ */ BEGIN", "E'\\'; x", "BEGIN ATOMIC CASE END"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, sql string) {
		got := TxControl(sql)
		if got == "" {
			return
		}
		first := strings.Fields(got)[0]
		if !slices.Contains([]string{"COMMIT", "END", "ABORT", "BEGIN", "START", "ROLLBACK", "PREPARE"}, first) {
			t.Fatalf("TxControl(%q) = %q", sql, got)
		}
	})
}
