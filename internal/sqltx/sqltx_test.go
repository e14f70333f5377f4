package sqltx

import (
	"encoding/json"
	"testing"
	"time"
)

func TestArg(t *testing.T) {
	now := time.Now()
	for _, tc := range []struct {
		name string
		in   any
		want any
	}{
		{"strings", []string{"a", `q"uote`, `back\slash`, "", "NULL", "{,}"}, `{"a","q\"uote","back\\slash","","NULL","{,}"}`},
		{"empty strings", []string{}, `{}`},
		{"int64s", []int64{-1, 0, 9223372036854775807}, `{-1,0,9223372036854775807}`},
		{"ints", []int{1, 2}, `{1,2}`},
		{"bytes", [][]byte{{0, 0xff}, {}, nil}, `{"\\x00ff","\\x",NULL}`},
		{"raw json", json.RawMessage(`{"a":1}`), `{"a":1}`},
		{"nil raw json", json.RawMessage(nil), nil},
		{"map", map[string]string{"k": "v"}, `{"k":"v"}`},
		{"string", "s", "s"},
		{"bytes pass through", []byte("b"), []byte("b")},
		{"time", now, now},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := Arg(tc.in)
			if b, ok := tc.want.([]byte); ok {
				if string(got.([]byte)) != string(b) {
					t.Fatalf("Arg = %v, want %v", got, tc.want)
				}
				return
			}
			if got != tc.want {
				t.Fatalf("Arg = %#v, want %#v", got, tc.want)
			}
		})
	}
}
