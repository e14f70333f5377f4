package onceflowtest_test

import (
	"testing"

	"github.com/onceflow/onceflow/onceflowtest"
)

func TestWithDatabase(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"postgres://u:p@h:5432/postgres?sslmode=disable", "postgres://u:p@h:5432/x?sslmode=disable"},
		{"postgresql://h/", "postgresql://h/x"},
		{"postgres://h", "postgres://h/x"},
		{"host=h user=u dbname=postgres", "host=h user=u dbname=postgres dbname=x"},
	} {
		got, err := onceflowtest.WithDatabase(tc.in, "x")
		if err != nil || got != tc.want {
			t.Errorf("withDatabase(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
}
