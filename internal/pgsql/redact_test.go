package pgsql

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

func TestRedactDSN(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"", ""},
		{"postgres://alice@db:5432/shop", "postgres://alice@db:5432/shop"},
		{"postgres://alice:s3cret@db:5432/shop", "postgres://alice:xxxxx@db:5432/shop"},
		{"postgresql://alice:s3cret@db/shop?sslmode=require", "postgresql://alice:xxxxx@db/shop?sslmode=require"},
		{"postgres://alice:@db/shop", "postgres://alice:xxxxx@db/shop"},
		{"postgres://alice:p%40ss%2Fw@db/shop", "postgres://alice:xxxxx@db/shop"},
		{"postgres://alice:s3cret@h1:5432,h2:5433/shop", "postgres://alice:xxxxx@h1:5432,h2:5433/shop"},
		// Malformed: a raw '@' or '/' in the password. Over-masking is fine, leaking is not.
		{"postgres://alice:p@ss@db/shop", "postgres://alice:xxxxx@db/shop"},
		{"postgres://alice:pa/ss@db/shop", "postgres://alice:xxxxx@db/shop"},
		// An '@' in a query value is not userinfo.
		{"postgres://db/shop?application_name=me@example.com", "postgres://db/shop?application_name=me@example.com"},
		{"postgres://db/shop?password=s3cret&sslmode=disable", "postgres://db/shop?password=xxxxx&sslmode=disable"},
		{"postgres://db/shop?sslmode=verify-full&sslpassword=keypass", "postgres://db/shop?sslmode=verify-full&sslpassword=xxxxx"},
		{"postgres://db/shop?pass%77ord=s3cret", "postgres://db/shop?pass%77ord=xxxxx"},
		{"postgres://u:a@db/shop?password=b", "postgres://u:xxxxx@db/shop?password=xxxxx"},
		// Keyword/value form, quoted or not, spaces around '=' allowed.
		{"host=db user=alice password=s3cret dbname=shop", "host=db user=alice password=xxxxx dbname=shop"},
		{"host=db password = s3cret dbname=shop", "host=db password = xxxxx dbname=shop"},
		{"host=db password='s3 cr\\'et' dbname=shop", "host=db password=xxxxx dbname=shop"},
		{"host=db sslpassword=keypass", "host=db sslpassword=xxxxx"},
		{"host=db PASSWORD=s3cret", "host=db PASSWORD=xxxxx"},
		{"host=db user=password", "host=db user=password"},
	} {
		if got := RedactDSN(c.in); got != c.want {
			t.Errorf("RedactDSN(%q)\n got %q\nwant %q", c.in, got, c.want)
		}
		// Masking twice, or text around the string, changes nothing more.
		if got := RedactDSN("(default " + RedactDSN(c.in) + ")"); got != "(default "+c.want+")" {
			t.Errorf("RedactDSN twice of %q: %q", c.in, got)
		}
	}
}

func TestRedactError(t *testing.T) {
	if RedactError(nil, "postgres://u:s3cret@h/db") != nil {
		t.Fatal("RedactError(nil) is not nil")
	}
	base := errors.New("boom")
	for _, c := range []struct {
		dsn, msg string
	}{
		{"postgres://u:s3cretPW@h/db", "cannot parse `postgres://u:s3cretPW@h/db`: bad"},
		{"postgres://u:s3cretPW@h/db", "server said s3cretPW is wrong"},
		{"postgres://u:p%40ssword1@h/db", "auth p@ssword1 failed, from postgres://u:p%40ssword1@h/db"},
		{"host=h password='two words'", "password 'two words' rejected"},
		{"host=h password=s3cretPW", "dial host=h password=s3cretPW failed"},
		{"postgres://h/db", "other url postgres://x:leakedPW@elsewhere/db"},
	} {
		err := RedactError(fmt.Errorf("%s: %w", c.msg, base), c.dsn)
		for _, secret := range []string{"s3cretPW", "p@ssword1", "p%40ssword1", "two words", "leakedPW"} {
			if strings.Contains(err.Error(), secret) {
				t.Errorf("RedactError(%q, %q) = %q: still shows %q", c.msg, c.dsn, err, secret)
			}
		}
		if !errors.Is(err, base) {
			t.Errorf("RedactError(%q) no longer wraps the original error", c.msg)
		}
	}
	// A password too short to replace as a literal is still masked where it is DSN-shaped,
	// and the rest of the text is left readable.
	err := RedactError(errors.New("failed: postgres://u:ab@h/db, table abc"), "postgres://u:ab@h/db")
	if got := err.Error(); got != "failed: postgres://u:xxxxx@h/db, table abc" {
		t.Errorf("short password: %q", got)
	}
	// pgx's own parse errors keep their type for errors.As.
	_, perr := pgconn.ParseConfig("postgres://u:s3cretPW@h:notaport/db")
	var pce *pgconn.ParseConfigError
	if err := RedactError(perr, "postgres://u:s3cretPW@h:notaport/db"); !errors.As(err, &pce) || strings.Contains(err.Error(), "s3cretPW") {
		t.Errorf("parse error: %v", err)
	}
}
