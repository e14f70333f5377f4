package relay

import (
	"encoding/json"
	"maps"
	"testing"
)

var metadataSeeds = []string{
	`{}`,
	` { } `,
	`{"partition_key": "order-42"}`,
	`{"name": "Ünïcode ✓", "seq": "7", "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}`,
	`{"a":"1","a":"2"}`,
	`{"esc": "a\"b\\c\u00e9\n"}`,
	`{"n": 1}`,
	`{"a": "b",}`,
	`{"a" "b"}`,
	`null`,
	`[]`,
	`{"a": "b"} x`,
	"{\"bad\": \"\xff\"}",
	`{"a":`,
	`{"a": "unterminated`,
	``,
}

func TestParseMetadata(t *testing.T) {
	for _, in := range metadataSeeds {
		got, err := parseMetadata([]byte(in))
		var want map[string]string
		wantErr := json.Unmarshal([]byte(in), &want)
		if (err != nil) != (wantErr != nil) || (err == nil && !maps.Equal(got, want)) {
			t.Errorf("parseMetadata(%q) = %v, %v; encoding/json gives %v, %v", in, got, err, want, wantErr)
		}
	}
}

// FuzzParseMetadata: the fast path may decline, but whenever it answers, it answers exactly
// what encoding/json does.
func FuzzParseMetadata(f *testing.F) {
	for _, s := range metadataSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		fast, ok := parseFlatObject(b)
		var want map[string]string
		wantErr := json.Unmarshal(b, &want)
		if ok && (wantErr != nil || !maps.Equal(fast, want)) {
			t.Fatalf("fast path on %q = %v; encoding/json gives %v, %v", b, fast, want, wantErr)
		}
		got, err := parseMetadata(b)
		if (err != nil) != (wantErr != nil) || (err == nil && !maps.Equal(got, want)) {
			t.Fatalf("parseMetadata(%q) = %v, %v; encoding/json gives %v, %v", b, got, err, want, wantErr)
		}
	})
}

func BenchmarkParseMetadata(b *testing.B) {
	in := []byte(`{"name": "orders.placed", "partition_key": "key-aa", "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}`)
	b.Run("fast", func(b *testing.B) {
		for range b.N {
			_, _ = parseMetadata(in)
		}
	})
	b.Run("encoding/json", func(b *testing.B) {
		for range b.N {
			var m map[string]string
			_ = json.Unmarshal(in, &m)
		}
	})
}
